"""Latency and peak memory per phase, on the accuracy code path (`profile=true`).

The engine runs a sample exactly as for accuracy and brackets its phases with `PhaseProfiler.phase`:
`prefill` (the compressed segment, its compression, the appended question) and `decode` (the greedy
steps). The teacher-forced NLL runs between them, outside both. Per phase:

- on CUDA, the caching allocator's peak (`torch.cuda.max_memory_allocated`, reset at the phase start);
- on CPU, the process's resident-set high-water mark (`VmHWM`, reset at the phase start by writing 5 to
  `/proc/self/clear_refs`; Linux only), and the bytes of the distinct storages of the tensors alive at the
  phase's end (found through the garbage collector: model weights, the cache, anything else held).

Both are recorded as absolute peaks and as the growth over the phase's start. Latency comes from the
engine's own timers (prefill, compression, each decode step), summarised by `latency_summary`. With
`profiler.stages=true` the decode phase also times the named stages of each step (`kvbench.core.stages`), recorded
as `stage_ms` (mean milliseconds per step after the warm-up) beside `decode_step_ms`.
"""

from __future__ import annotations

import contextlib
import gc
import re
import statistics
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvbench.core.stages import StageTimer

_STATUS = Path("/proc/self/status")


_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_bytes(field: str) -> int | None:
    try:
        match = re.search(rf"^{field}:\s+(\d+) kB", _STATUS.read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) * 1024 if match else None


def _reset_rss_peak() -> bool:
    try:
        _CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


def _is_tensor(obj: object) -> bool:
    try:
        return isinstance(obj, torch.Tensor)
    except ReferenceError:  # a weak-reference proxy whose referent is gone (isinstance reads its __class__)
        return False


def live_tensor_bytes() -> int:
    """Bytes of the distinct storages of every tensor the garbage collector can reach."""
    storages: dict[tuple[str, int], int] = {}
    with warnings.catch_warnings():  # isinstance on some module objects trips their deprecation warnings
        warnings.simplefilter("ignore")
        objects = [obj for obj in gc.get_objects() if _is_tensor(obj)]
    for obj in objects:
        try:
            if obj.device.type != "meta":
                storage = obj.untyped_storage()
                storages[(str(obj.device), storage.data_ptr())] = storage.nbytes()
        except (RuntimeError, ReferenceError):  # tensors without storage (sparse, functional wrappers)
            continue
    return sum(storages.values())


class PhaseProfiler:
    """Peak memory of each phase a sample goes through; a phase entered twice (a later turn) keeps its max.

    `devices`: every GPU a layer-sharded model computes on (`LoadedModel.devices`); each is measured, the peaks
    and live bytes are their sums, and `peak_bytes_<phase>_by_device` gives each one's peak when there are
    several. `stages`: time each decode step's stages too (`kvbench.core.stages`: a device synchronisation around
    each, so the step runs slower than untimed)."""

    def __init__(self, device: torch.device, warmup_steps: int = 2, devices: list[torch.device] | None = None,
                 stages: bool = False):
        self.device = device
        self.stages = StageTimer(device) if stages else None
        self.warmup_steps = warmup_steps
        self.kind = "cuda_allocator" if device.type == "cuda" else "cpu_rss_high_water_mark"
        self.gpus = [d for d in dict.fromkeys(devices or [device]) if d.type == "cuda"] or [device]
        self.peaks: dict[str, int] = {}
        self.growth: dict[str, int] = {}
        self.live: dict[str, int] = {}
        self.by_device: dict[str, dict[str, int]] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.device.type == "cuda":
            start = 0
            for gpu in self.gpus:
                torch.cuda.synchronize(gpu)
                torch.cuda.reset_peak_memory_stats(gpu)
                start += torch.cuda.memory_allocated(gpu)
        else:
            start = _status_bytes("VmRSS") if _reset_rss_peak() else None
        with self.stages.active() if self.stages is not None and name == "decode" else contextlib.nullcontext():
            yield
        if self.device.type == "cuda":
            each = {}
            for gpu in self.gpus:
                torch.cuda.synchronize(gpu)
                each[str(gpu)] = torch.cuda.max_memory_allocated(gpu)
            peak, live = sum(each.values()), sum(torch.cuda.memory_allocated(gpu) for gpu in self.gpus)
            if len(self.gpus) > 1:
                held = self.by_device.setdefault(name, {})
                for gpu, value in each.items():
                    held[gpu] = max(held.get(gpu, 0), value)
        else:
            peak = _status_bytes("VmHWM") if start is not None else None
            live = live_tensor_bytes()
        if peak is not None:
            self.peaks[name] = max(self.peaks.get(name, 0), peak)
            self.growth[name] = max(self.growth.get(name, 0), peak - start)
        self.live[name] = max(self.live.get(name, 0), live)

    def latency(self, prefill_s: float, compress_s: float, step_s: list[float], new_tokens: int) -> dict[str, Any]:
        out = latency_summary(prefill_s, compress_s, step_s, new_tokens, self.warmup_steps)
        if self.stages is not None:  # over the steps `stage_ms` averages, so the stages' rest is the step's mean less them
            timed = step_s[self.warmup_steps:] or step_s
            out["decode_ms_mean"] = 1e3 * sum(timed) / len(timed) if timed else None
        return out

    def fields(self) -> dict[str, Any]:
        out: dict[str, Any] = {"memory_kind": self.kind}
        for name in ("prefill", "decode"):
            out[f"peak_bytes_{name}"] = self.peaks.get(name)
            out[f"peak_growth_bytes_{name}"] = self.growth.get(name)
            out[f"live_tensor_bytes_{name}"] = self.live.get(name)
            if name in self.by_device:  # a layer-sharded model: each GPU's own allocator peak
                out[f"peak_bytes_{name}_by_device"] = self.by_device[name]
        if self.stages is not None:
            out["stage_ms"] = self.stages.summary(self.warmup_steps)
        return out


def latency_summary(prefill_s: float, compress_s: float, step_s: list[float], new_tokens: int,
                    warmup: int) -> dict[str, Any]:
    """Time to first token, per-token decode latency (median and p90 over the steps after `warmup`),
    end-to-end time and throughput of one run of a sample."""
    timed = [1e3 * s for s in step_s[warmup:]] or [1e3 * s for s in step_s]
    ttft = prefill_s + compress_s
    e2e = ttft + sum(step_s)
    return {
        "ttft_s": ttft,
        "prefill_s": prefill_s,
        "compress_s": compress_s,
        "decode_ms_median": statistics.median(timed) if timed else None,
        "decode_ms_p90": float(np.percentile(timed, 90)) if timed else None,
        "decode_steps_timed": len(timed),
        "e2e_s": e2e,
        "tokens_per_s": new_tokens / e2e if e2e > 0 else None,
    }


def is_out_of_memory(exc: BaseException) -> bool:
    """An allocation failure: CUDA's OutOfMemoryError, or the CPU allocator's (a RuntimeError or MemoryError)."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


def combine_repeats(records: list[dict[str, Any]], warmup_steps: int) -> dict[str, Any]:
    """One record from repeated runs of a sample: the first run's record, its `profile` recomputed over all
    runs (decode steps pooled after each run's warm-up; prefill, compression and end-to-end times as medians;
    memory peaks as maxima), with whether every run predicted the same tokens (greedy decoding must)."""
    first = dict(records[0])
    profiles = [r["profile"] for r in records]
    steps = [ms for p in profiles for ms in p["decode_step_ms"][warmup_steps:]]
    profile = dict(profiles[0])
    for key in ("ttft_s", "prefill_s", "compress_s", "e2e_s", "tokens_per_s"):
        values = [p[key] for p in profiles if p[key] is not None]
        profile[key] = statistics.median(values) if values else None
    for key in profile:
        if key.startswith(("peak_", "live_")):
            values = [p[key] for p in profiles if p[key] is not None]
            profile[key] = max(values) if values else None
    stage_runs = [p["stage_ms"] for p in profiles if "stage_ms" in p]
    if stage_runs:  # each run's mean per step; the repeats' mean (each run times as many steps)
        names = sorted({name for run in stage_runs for name in run})
        profile["stage_ms"] = {name: sum(run.get(name, 0.0) for run in stage_runs) / len(stage_runs) for name in names}
        profile["decode_ms_mean"] = statistics.fmean(steps) if steps else None
    profile.update(
        decode_ms_median=statistics.median(steps) if steps else None,
        decode_ms_p90=float(np.percentile(steps, 90)) if steps else None,
        decode_steps_timed=len(steps),
        repeats=len(records),
        repeats_identical=len({_outputs(r) for r in records}) == 1,
    )
    first["profile"] = profile
    return first


def _outputs(record: dict[str, Any]) -> str:
    return repr([(t["prediction"], t["nll"]) for t in record["turns"]])
