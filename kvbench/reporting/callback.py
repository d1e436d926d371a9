"""The Hydra callback that prints a sweep's results table when the sweep ends (or is aborted)."""

from __future__ import annotations

import atexit
import logging
import sys
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from kvbench.reporting.table import _split, report_text
from kvbench.results.sweeps import note_point, start_sweep, sweep_points

log = logging.getLogger(__name__)


class PrintSweepSummary(Callback):
    """Hydra callback printing the results table of a multirun sweep when it ends.

    Hydra's sweepers raise once a batch of jobs contains a failed one, and then never call
    ``on_multirun_end``; so the table is also printed at interpreter exit if the sweep did not end normally,
    with the failed jobs that local launchers reported (remote launchers run ``on_job_end`` on the nodes).
    Rendering errors are logged, never raised: the results are on disk either way, and a reporting bug must
    not turn a finished sweep into a failed one.
    """

    def __init__(self, markdown: bool = False, pivot: str | None = None) -> None:
        self.markdown = markdown
        self.pivot = _split(pivot) if pivot else None
        self.sweep_dir: Path | None = None
        self.failed: list[str] = []
        self.sweep_id: str | None = None
        self.note: str | None = None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.sweep_dir = Path(config.hydra.sweep.dir)
        # each job's end (here or on a SLURM node, which inherits the environment) notes its directory in a
        # file of this sweep's own, so the closing table shows this sweep's points, not the whole results tree
        self.sweep_id = start_sweep()
        self.note = (config.get("report") or {}).get("note")  # how to read the table: printed under it
        skipped = (config.get("report") or {}).get("not_in_kvbench")
        if skipped:  # a paper's methods that kvbench lacks: said once, never silently absent
            name = config.hydra.runtime.choices.get("experiment") or self.sweep_dir.name
            print(f"{name}: skipping methods not in kvbench: {', '.join(skipped)}", flush=True)
        atexit.register(self._print, aborted=True)

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if job_return.status == JobStatus.FAILED:
            self.failed.append(" ".join(job_return.overrides or []))
        output_dir = OmegaConf.select(config, "hydra.runtime.output_dir")
        if output_dir:  # here or on a SLURM node (where the sweep id comes through the environment)
            note_point(Path(str(config.hydra.sweep.dir)), Path(str(output_dir)))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        atexit.unregister(self._print)
        self.sweep_dir = Path(config.hydra.sweep.dir)
        self._print(aborted=False)

    def _print(self, aborted: bool) -> None:
        if self.sweep_dir is None:
            return
        try:
            run_dirs = sweep_points(self.sweep_dir, self.sweep_id) if self.sweep_id else None
            text = report_text(self.sweep_dir, markdown=self.markdown, pivot=self.pivot, run_dirs=run_dirs)
        except Exception:  # see the class docstring
            log.exception("could not summarise sweep %s", self.sweep_dir)
            return
        header = f"Results of sweep {self.sweep_dir}"
        if aborted:
            header += " (sweep did not finish: partial results)"
        print(f"\n{header}\n{text}" + (f"\n\n{self.note}" if self.note else ""))
        for overrides in self.failed:
            print(f"FAILED: {overrides}")
        sys.stdout.flush()
