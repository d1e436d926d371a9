"""`python -m kvbench.figures RESULTS_DIR --layout NAME`: see kvbench.cli.figures."""

import sys

from kvbench.cli.figures import main

if __name__ == "__main__":
    sys.exit(main())
