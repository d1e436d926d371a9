"""`python -m kvbench.report ...` (= `kvbench report ...`), and the sweep callback's old config path."""

import sys

from kvbench.cli.report import main
from kvbench.reporting.callback import PrintSweepSummary

__all__ = ["PrintSweepSummary", "main"]

if __name__ == "__main__":
    sys.exit(main())
