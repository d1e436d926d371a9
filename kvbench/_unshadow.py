"""Import the installed kvbench even when the working directory has a folder named `kvbench` (the checkout
itself, run from the folder that contains it): `python -m` puts the working directory first on the import path,
where that folder is taken for a namespace package and its `results/` for `kvbench.results`. Imported first by
every `python -m kvbench...` module; without such a folder it does nothing."""

import os
import sys


def _unshadow() -> None:
    package = sys.modules.get("kvbench")
    if package is None or getattr(package, "__file__", None) is not None:
        return  # the real package (a namespace package has no __file__)
    here = os.path.dirname(os.path.abspath(__file__))  # this file is in the real package
    package.__path__ = [here]
    package.__file__ = os.path.join(here, "__init__.py")
    if package.__spec__ is not None:
        package.__spec__.submodule_search_locations = [here]


_unshadow()
