"""`python -m kvbench.figures RESULTS_DIR --layout NAME`: see kvbench.cli.figures."""

import kvbench._unshadow  # noqa: F401, I001 - first: a folder named kvbench in the working directory
import sys

from kvbench.cli.figures import main

if __name__ == "__main__":
    sys.exit(main())
