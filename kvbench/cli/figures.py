"""`kvbench figures RESULTS_DIR --layout NAME` (or `python -m kvbench.figures ...`): a paper's efficiency figure
and table."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from kvbench.reporting.efficiency import LAYOUTS, render


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvbench figures", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results_dir", type=Path)
    parser.add_argument("--layout", required=True, choices=sorted(LAYOUTS))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    try:
        paths = render(args.results_dir, args.layout, args.out)
    except ValueError as exc:
        print(f"kvbench: error: {exc}", file=sys.stderr)
        return 2
    print("\n".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
