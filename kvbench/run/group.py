"""Points decoded together: a local multirun groups points that share model, samples and engine settings."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from kvbench.core.errors import KVBenchError, one_line
from kvbench.results.store import point_lock
from kvbench.run.caches import release_host_memory
from kvbench.run.identity import POINT_KEYS
from kvbench.run.policy import run_rows
from kvbench.run.prepare import PreparedPoint, prepare_point
from kvbench.run.progress import SampleProgress, sample_count
from kvbench.tasks.base import Sample

log = logging.getLogger("kvbench")


# Samples each point recorded in this process's grouped phase, by run directory: its job then finds them
# recorded and says where they came from rather than that it resumes.
_GROUPED: dict[Path, int] = {}


def recorded_with_group(run_dir: Path) -> int:
    """How many samples of the point in `run_dir` this process recorded in a grouped decode."""
    return _GROUPED.get(Path(run_dir).resolve(), 0)


# A point's identity less what the points of one group differ in (method, budget); the engine section whole,
# its non-identity settings too (batch_rows, reuse_prefill, ...), since a group decodes under one EngineConfig.
GROUP_KEYS = tuple(k for k in POINT_KEYS if k not in ("method", "budget"))


def group_key(cfg: DictConfig) -> str | None:
    """Points with equal keys share a model, samples and engine settings, so their samples can decode as one
    batch (`run_grouped`); None for a point that runs alone (profiled points: their timings and peaks must be
    their own)."""
    if cfg.get("profile"):
        return None
    values = [cfg[k] for k in GROUP_KEYS]
    return "\n".join(OmegaConf.to_yaml(v, resolve=True) if isinstance(v, DictConfig) else str(v) for v in values)


def run_grouped(points: list[tuple[DictConfig, Path]], max_group: int) -> None:
    """Record the samples of several points that share a `group_key`, decoding each sample's points together.

    Per sample (per `engine.sample_batch` samples): every point still missing it joins one batch (at most
    `max_group` points): its own prefill and compression (one shared dense prefill through the snapshots), then
    one batched decode and NLL (`engine.run_group`); each point's record is appended to its own store as soon as
    the batch is done, so an interrupted group resumes at the samples each point lacks. Points that fail to
    prepare, or whose row raises (`_record_rows`), are left to their own job, which reports the error.
    """
    with contextlib.ExitStack() as locks:
        prepared = []
        for cfg, run_dir in {run_dir: (cfg, run_dir) for cfg, run_dir in points}.values():  # a point swept twice
            if not locks.enter_context(point_lock(run_dir, wait=False)):
                log.info("%s is being run by another process; its job waits for it", run_dir)
                continue
            try:
                prepared.append(prepare_point(cfg, run_dir))
            except KVBenchError as exc:
                log.info("%s runs alone: %s", run_dir, exc)
            except Exception as exc:  # noqa: BLE001 - its own job prepares it again and reports the error
                log.warning("%s failed to prepare (%s): it is left to its own job, which reports the error", run_dir,
                            one_line(exc))
        if len(prepared) >= 2:
            _run_group_samples(prepared, max_group)


def _run_group_samples(prepared: list[PreparedPoint], max_group: int) -> None:
    samples = prepared[0].samples
    todo = {p.run_dir: {s.id for s in p.todo()} for p in prepared}
    pending = [s for s in samples if any(s.id in ids for ids in todo.values())]
    if not pending:  # a rerun of a finished sweep: each job says its samples are recorded
        return
    per_batch = max(1, int(prepared[0].engine_cfg.sample_batch))
    log.info("decoding %d points together%s, %s to run", len(prepared),
             f" ({per_batch} samples at a time)" if per_batch > 1 else "",
             sample_count(pending, prepared[0].cfg.task.get("num_samples")))
    bar = SampleProgress(len(pending), f"group of {len(prepared)} points, {prepared[0].cfg.task.name}",
                         prepared[0].cfg.show_progress)
    failed: set[Path] = set()  # points left to their own jobs: a row of theirs raised
    for start in range(0, len(pending), per_batch):
        samples_now = pending[start:start + per_batch]
        for first in range(0, len(prepared), max_group):
            # sample-major, so a sample's rows follow one another and share its dense prefill (the snapshots)
            rows = [(point, sample) for sample in samples_now for point in prepared[first:first + max_group]
                    if sample.id in todo[point.run_dir] and point.run_dir not in failed]
            if rows:
                failed |= _record_rows(prepared[0], rows)
            for point, _ in rows:
                if point.run_dir not in failed:
                    key = point.run_dir.resolve()
                    _GROUPED[key] = _GROUPED.get(key, 0) + 1
        bar.update(len(samples_now))
        release_host_memory()
    bar.close()


def _record_rows(first: PreparedPoint, rows: list[tuple[PreparedPoint, Sample]]) -> set[Path]:
    """Record `rows` decoded together, and the run directories of the points whose row raised (none, mostly).

    A batch that raises (other than running out of memory, which `run_rows` retries row by row) is run again one
    row at a time, each record kept as soon as it exists (a row's bits do not depend on its batch), so that one
    point's error stops that point alone, as a job of Hydra's basic launcher would: the others of the sweep go on
    together, and the failed point is left to its own job, which runs it alone and reports the error."""
    if len(rows) > 1:
        try:
            run_rows(first, rows)
            return set()
        except Exception as exc:  # noqa: BLE001 - any error: the row that raised is found below, its job re-raises
            log.warning("a batch of %d rows failed (%s); running them one at a time", len(rows), one_line(exc))
    failed: set[Path] = set()
    for point, sample in rows:
        if point.run_dir in failed:
            continue
        try:
            run_rows(point, [(point, sample)])
        except Exception as exc:  # noqa: BLE001 - the point's own job runs it again and reports it
            log.warning("%s failed on sample %s (%s): it is left to its own job, which runs it alone and reports "
                        "the error", point.run_dir, sample.id, one_line(exc))
            failed.add(point.run_dir)
    return failed
