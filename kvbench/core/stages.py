"""Named stages of a decode step, timed when a profiled run asks for it (`profiler.stages=true`).

The attention dispatcher marks every decode step's `select` (a selection method's choice of rows) and
`attention`; a method marks its own parts inside them (CTKVR: `select/recall`, `select/rerank`, ...), and the
attention over selected rows splits into `attention/stored` (rows in the layer's storage) and
`attention/external` (rows a method keeps outside it, CTKVR's host rows). A stage's name is its path from
the outermost stage; a stage entered once per layer adds up over the layers of a step.

Without a timer, which is every run but a stage-timed profile, `stage` returns one shared null context:
nothing is timed or synchronised, and a compiled step's graph holds no trace of it. With a timer, each stage
synchronises the device on entry and exit, so a stage's time on a GPU is its kernels', not their launch; those
synchronisations slow the step itself, which is why stage-timed points are points of their own and decode
eagerly (`StageTimer` is active only in the decode phase of a profiled sample).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

from kvbench.core.devices import sync

_NULL = contextlib.nullcontext()
_TIMER: StageTimer | None = None


def stage(name: str) -> contextlib.AbstractContextManager:
    """`with stage(name):` times its block as a stage of the current decode step, when a timer is active."""
    return _NULL if _TIMER is None else _TIMER.time(name)


def end_step() -> None:
    """The decode loop's mark after each timed step: the stages since the last mark were that step's."""
    if _TIMER is not None:
        _TIMER.end_step()


class StageTimer:
    """Seconds per stage of each decode step, on `device`'s clock (synchronised around every stage)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.steps: list[dict[str, float]] = []
        self._current: dict[str, float] = {}
        self._path: list[str] = []

    @contextlib.contextmanager
    def active(self) -> Iterator[StageTimer]:
        """Make this the timer `stage` reports to, for the block (the decode phase)."""
        global _TIMER
        previous, _TIMER = _TIMER, self
        try:
            yield self
        finally:
            _TIMER = previous
            self._current, self._path = {}, []  # an interrupted step is no step

    @contextlib.contextmanager
    def time(self, name: str) -> Iterator[None]:
        self._path.append(name)
        key = "/".join(self._path)
        sync(self.device)
        start = time.perf_counter()
        try:
            yield
        finally:
            sync(self.device)
            self._current[key] = self._current.get(key, 0.0) + time.perf_counter() - start
            self._path.pop()

    def end_step(self) -> None:
        self.steps.append(self._current)
        self._current = {}

    def summary(self, warmup: int) -> dict[str, float]:
        """Mean milliseconds per decode step of each stage, over the steps after `warmup` (all of them when there
        are no more); a step that skipped a stage counts zero for it."""
        steps = self.steps[warmup:] or self.steps
        names = sorted({name for step in steps for name in step})
        return {name: 1e3 * sum(step.get(name, 0.0) for step in steps) / len(steps) for name in names}
