"""A slice of a `_cpu` preset run end to end, as a user would: the sweep through `python -m kvbench -m`, then
`python -m kvbench report experiment=...` over what it stored. The slice narrows the preset's grid with ordinary
overrides (fewer methods, budgets or samples); everything else is the preset's own settings."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_preset_slice(name: str, tmp_path: Path, *overrides: str, timeout: int = 900) -> Path:
    """Sweeps `experiment=name` narrowed by `overrides` into `tmp_path/results`, reports it into
    `tmp_path/report`, and returns the report folder (table.md, table.csv, ...). Fails with the tail of the
    command's stderr when either step exits non-zero."""
    results, report = tmp_path / "results", tmp_path / "report"
    common = [f"experiment={name}", f"results_dir={results}", *overrides]
    sweep = subprocess.run([sys.executable, "-m", "kvbench", "-m", *common, "show_progress=false"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=timeout)
    assert sweep.returncode == 0, f"sweep of {name} failed:\n{sweep.stderr[-4000:]}"
    shown = subprocess.run([sys.executable, "-m", "kvbench", "report", *common, "--out", str(report)], cwd=tmp_path,
                           capture_output=True, text=True, timeout=timeout)
    assert shown.returncode == 0, f"report of {name} failed:\n{shown.stderr[-4000:]}"
    assert (report / "table.md").is_file(), f"report of {name} wrote no table.md:\n{shown.stdout[-2000:]}"
    return report
