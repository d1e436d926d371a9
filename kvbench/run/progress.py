"""Progress a user can plan with: how many samples a point runs and why, the time per sample once the first
is done, the time left for the point and, in a local multirun, for the sweep."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from tqdm.auto import tqdm

from kvbench.tasks.base import Sample

log = logging.getLogger("kvbench")


def duration(seconds: float) -> str:
    """`42 s`, `7.5 min`, `3.2 h`."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.1f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def sample_count(samples: Sequence[Sample], num_samples: int | None) -> str:
    """`55 samples (task.num_samples=5 per subtask x 11 subtasks)`: a suite's count is per subtask."""
    subtasks = len({s.task for s in samples})
    if subtasks > 1 and num_samples:
        return f"{len(samples)} samples (task.num_samples={num_samples} per subtask x {subtasks} subtasks)"
    return f"{len(samples)} samples"


class SampleProgress:
    """A tqdm bar over samples that, after the first sample, also logs the time per sample and the estimate
    for the rest (the bar's own estimate is lost in logs that are not a terminal, e.g. SLURM's)."""

    def __init__(self, total: int, desc: str, enabled: bool) -> None:
        self.bar = tqdm(total=total, desc=desc, unit="sample", disable=not enabled or not total)
        self.desc, self.total, self.done, self.start = desc, total, 0, time.perf_counter()

    def update(self, n: int = 1, **postfix: str) -> None:
        if postfix:
            self.bar.set_postfix(**postfix)
        self.bar.update(n)
        first = self.done == 0
        self.done += n
        if first and self.done < self.total:
            per = (time.perf_counter() - self.start) / self.done
            log.info("%s: %s per sample; about %s left for the other %d", self.desc, duration(per),
                     duration(per * (self.total - self.done)), self.total - self.done)

    def close(self) -> None:
        self.bar.close()


class SweepEstimate:
    """The sweep's remaining time from the groups of points done so far (groups assumed to cost alike)."""

    def __init__(self, groups: int) -> None:
        self.groups, self.done, self.start = groups, 0, time.perf_counter()

    def group_done(self) -> None:
        self.done += 1
        if self.done < self.groups:
            per = (time.perf_counter() - self.start) / self.done
            log.info("sweep: %d of %d groups of points done; about %s left", self.done, self.groups,
                     duration(per * (self.groups - self.done)))
