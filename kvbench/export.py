"""`python -m kvbench.export task=... out=FILE`: see kvbench.cli.export."""

import kvbench._unshadow  # noqa: F401, I001 - first: a folder named kvbench in the working directory
import sys

from kvbench.cli.export import main

if __name__ == "__main__":
    sys.exit(main())
