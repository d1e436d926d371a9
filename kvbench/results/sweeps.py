"""Which points a sweep ran: each job appends its point directory to a file named by the sweep's id (passed to
the jobs, local or on SLURM nodes, through the environment), so a sweep's closing table lists its own points
even in a results tree that holds earlier, unrelated ones."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

SWEEP_ID_VARIABLE = "KVBENCH_SWEEP_ID"
SWEEPS_DIR = ".sweeps"


def start_sweep() -> str:
    """A new sweep id, exported to the jobs this process starts."""
    sweep_id = uuid.uuid4().hex[:12]
    os.environ[SWEEP_ID_VARIABLE] = sweep_id
    return sweep_id


def note_point(results_dir: Path, run_dir: Path) -> None:
    """Record `run_dir` as a point of the running sweep (none outside a sweep). One short append: whole lines
    from concurrent jobs on one file system."""
    sweep_id = os.environ.get(SWEEP_ID_VARIABLE)
    if not sweep_id:
        return
    path = Path(results_dir) / SWEEPS_DIR / sweep_id
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, f"{Path(run_dir).resolve()}\n".encode())
    finally:
        os.close(fd)


def sweep_points(results_dir: Path, sweep_id: str) -> list[Path]:
    """The point directories the sweep's jobs noted (none yet: an empty list)."""
    path = Path(results_dir) / SWEEPS_DIR / sweep_id
    if not path.exists():
        return []
    return sorted({Path(line) for line in path.read_text().splitlines() if line.strip()})
