"""`python -m kvbench.export task=... out=FILE`: see kvbench.cli.export."""

import sys

from kvbench.cli.export import main

if __name__ == "__main__":
    sys.exit(main())
