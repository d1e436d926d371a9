"""Running rows of points: one alone, several decoded together, an out-of-memory sample recorded as such,
profiled samples repeated and given roofline ratios."""

from __future__ import annotations

import gc
import logging
from typing import Any

import torch
from omegaconf import DictConfig

from kvbench.engine.config import EngineConfig
from kvbench.engine.sample import run_group, run_sample
from kvbench.engine.snapshots import PrefillSnapshots
from kvbench.models import LoadedModel
from kvbench.profiling.profiler import PhaseProfiler, combine_repeats, is_out_of_memory
from kvbench.profiling.roofline import decode_weight_bytes, machine_peaks, roofline
from kvbench.run.prepare import PreparedPoint
from kvbench.tasks.base import Sample

log = logging.getLogger("kvbench")


def run_or_oom(cfg: DictConfig, lm: "LoadedModel", method: Any, budget: Any, sample: "Sample",
               engine_cfg: "EngineConfig", snapshots: PrefillSnapshots | None = None) -> dict[str, Any]:
    """The sample's record (profiled when `profile=true`), or, when it runs out of memory, a record saying so:
    the point and the sweep go on (an efficiency sweep finds its OOM limit this way). `snapshots`: the
    prefills it may share (`engine.run_sample`; None: none)."""
    try:
        if not cfg.profile:
            return run_sample(lm, method, budget, sample, engine_cfg, snapshots=snapshots)
        runs = [run_sample(lm, method, budget, sample, engine_cfg,
                           profiler=PhaseProfiler(lm.device, cfg.profiler.warmup_steps, devices=lm.devices(),
                                                  stages=bool(cfg.profiler.get("stages", False))))
                for _ in range(max(1, cfg.profiler.repeats))]
        record = combine_repeats(runs, cfg.profiler.warmup_steps)
        dtype = str(lm.dtype).replace("torch.", "")
        # a plain model's weights as the config counts them (records as before), quantised ones as stored
        weights = decode_weight_bytes(lm) if lm.quantization != "none" else None
        record["roofline"] = roofline(record, lm.model.config, dtype, machine_peaks(lm.device), weights)
        return record
    except Exception as exc:  # noqa: BLE001 - only allocation failures are caught, the rest re-raised
        if not is_out_of_memory(exc):
            raise
        log.warning("sample %s: out of memory (%s); recorded as oom", sample.id, str(exc).splitlines()[0])
        gc.collect()
        if lm.device.type == "cuda":
            torch.cuda.empty_cache()
        return {"sample_id": sample.id, "task": sample.task, "oom": True, "error": str(exc).splitlines()[0],
                "score": None, "nll": None, "turns": [], "meta": sample.meta}


def run_rows(first: PreparedPoint, rows: list[tuple[PreparedPoint, "Sample"]]) -> list[dict[str, Any]]:
    """Record (point, sample) rows that share a model and engine settings: one row through `run_or_oom`,
    several decoded together (`engine.run_group`); a batch that runs out of memory is retried row by row.
    Each record is appended to its point's store as soon as it exists."""
    records = None
    if len(rows) > 1:
        try:
            records = run_group(first.lm, [(p.method, p.budget, sample) for p, sample in rows], first.engine_cfg,
                                snapshots=first.snapshots)
        except Exception as exc:  # noqa: BLE001 - only allocation failures are caught, the rest re-raised
            if not is_out_of_memory(exc):
                raise
            log.warning("a batch of %d rows ran out of memory; running them one by one", len(rows))
            gc.collect()
    if records is None:
        records = [run_or_oom(p.cfg, p.lm, p.method, p.budget, sample, p.engine_cfg, p.snapshots)
                   for p, sample in rows]
    for (point, _), record in zip(rows, records):
        point.append(record)
    return records
