"""`kvbench report SOURCE`: the point table, and the preset's paper layout written under <results_dir>/report/."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from kvbench.core.errors import KVBenchError
from kvbench.reporting.claims import verdicts, write_claims
from kvbench.reporting.paper import build, skipped_line
from kvbench.reporting.paper_tables import Source, resolve
from kvbench.reporting.preset_points import left_out_lines, select_points
from kvbench.reporting.table import _split, point_table, points_text
from kvbench.reporting.uncertainty import detectable_text
from kvbench.reporting.wandb import publish_report
from kvbench.results.collect import collect
from kvbench.results.store import RECORDS_FILE


def _argv_with_options(argv: Sequence[str]) -> list[str]:
    """Accept the Hydra-style spellings too: `out=DIR`, `wandb.publish=true`, `wandb.project=P`."""
    spelled = {"out": "--out", "wandb.project": "--wandb-project", "wandb.entity": "--wandb-entity"}
    out: list[str] = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if sep and key in spelled:
            out += [spelled[key], value]
        elif sep and key == "wandb.publish":
            out += ["--publish"] if value.lower() in ("true", "1", "yes") else []
        else:
            out.append(arg)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Print a results table and write the full report; exit status 1 when there are no records."""
    parser = argparse.ArgumentParser(
        prog="kvbench report", description="Tables, figures and an HTML page from stored records.",
        epilog="SOURCE: experiment=NAME (a preset: its results_dir, layout and expected grid) or RESULTS_DIR "
               "(any results tree). Writes <results_dir>/report/ (index.html, table.md/.csv/.tex, points.csv, "
               "figures as PNG and PDF); see kvbench/reporting/paper.py.")
    parser.add_argument("source", metavar="SOURCE|RESULTS_DIR", help="experiment=NAME, or a results directory")
    parser.add_argument("overrides", nargs="*", default=[], metavar="KEY=VALUE",
                        help="with experiment=NAME: the overrides the sweep ran with (results_dir=..., budget=64,128)")
    parser.add_argument("--out", type=Path, help="report directory (default: <results_dir>/report)")
    parser.add_argument("--no-files", action="store_true", help="only print the table")
    parser.add_argument("--publish", action="store_true",
                        help="also build a W&B report (wandb.publish=true); without network: says so, static report only")
    parser.add_argument("--wandb-project", default="kvbench")
    parser.add_argument("--wandb-entity", default=None)
    parser.add_argument("--csv", type=Path,
                        help="also write the full point table (unrounded, not pivoted) to this file")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    parser.add_argument("--pivot", help="comma-separated point fields to spread across columns, e.g. method,budget")
    args = parser.parse_args(_argv_with_options(list(sys.argv[1:] if argv is None else argv)))
    try:
        source = resolve(args.source, args.overrides)
    except KVBenchError as err:
        parser.error(str(err))
    if source.spec.kind == "claims" or (source.grid is None and verdicts(source.root)
                                        and not any(source.root.rglob(RECORDS_FILE))):
        return _claims_report(source, args.out)
    df, left_out = select_points(source, collect(source.root) if source.root.is_dir() else pd.DataFrame())
    for line in left_out_lines(left_out):
        print(line)
    table = point_table(df)
    try:
        if args.csv is not None:
            table.to_csv(args.csv, index=False)
        if not table.empty:
            try:
                print(points_text(table, markdown=args.markdown, pivot=_split(args.pivot) if args.pivot else None))
            except ValueError as err:
                parser.error(str(err))
        else:
            print(f"no records under {source.root}" + (" but those left out" if left_out else ""), file=sys.stderr)
        preset = source.grid is not None
        if args.no_files or (table.empty and not preset):
            return 0 if not table.empty else 1
        result = build(source, args.out)
    except OSError as err:  # an unwritable --out or --csv: say which, not a traceback
        parser.error(f"cannot write {err.filename or args.out or args.csv}: {err.strerror or err}")
    except KVBenchError as err:  # e.g. two points that would share a cell of the paper's table
        parser.error(str(err))
    if source.spec.not_in_kvbench:
        print(skipped_line(source.name, source.spec))
    if result["missing"]:
        print(f"{len(result['missing'])} expected points have no records (shown as 'missing')")
    if result["stats"]:
        print(detectable_text(result["stats"]["detectable"], source.name))
    print(f"report: {result['out_dir'] / 'index.html'} ({len(result['figures'])} figures)")
    if args.publish:
        print(publish_report(result, project=args.wandb_project, entity=args.wandb_entity))
    return 0 if not table.empty else 1


def _claims_report(source: Source, out: Path | None) -> int:
    """A results tree of `kvbench analyze` verdicts: their table printed and the claims report written."""
    result = write_claims(source.root, out or source.root / "report", source.spec.title)
    if result["table"].empty:
        print(f"no verdicts under {source.root} (run: python -m kvbench analyze experiment={source.name})",
              file=sys.stderr)
        return 1
    print(result["table"].to_markdown(index=False, disable_numparse=True))
    print(f"report: {result['out_dir'] / 'index.html'} ({len(result['figures'])} figures)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
