"""A point's identity: what decides its numbers, hashed into its directory name (the `kvbench_point_dir`
resolver Hydra's run and sweep directories use)."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from kvbench.methods import METHODS
from kvbench.results.store import point_hash

# The config sections and settings a point's identity hashes (config names, not the fields records show:
# results.collect.POINT_FIELDS); changing the set changes every point hash.
POINT_KEYS = ("model", "task", "method", "budget", "compress_question", "engine", "seed")


# Engine settings that change speed or memory bookkeeping but never a prediction.
# batch_rows changes rounding, not the experiment: records say `decode_batched_rows` when it was above 1.
NON_IDENTITY_ENGINE_KEYS = ("reuse_prefill", "snapshot_window", "snapshot_cache_mb", "topk_recall", "sample_batch",
                            "batch_rows")


def point_identity(cfg: DictConfig) -> dict[str, Any]:
    point = {k: OmegaConf.to_container(cfg[k], resolve=True) if isinstance(cfg[k], DictConfig) else cfg[k]
             for k in POINT_KEYS}
    point["engine"] = {k: v for k, v in point["engine"].items() if k not in NON_IDENTITY_ENGINE_KEYS}
    # a null method parameter means "the method's default behaviour": a point from before the parameter
    # existed is the same point
    point["method"] = {k: v for k, v in point["method"].items() if v is not None}
    ratio = cfg.get("compression_ratio")
    if ratio is not None:  # kvpress's convention replaces the budget (a new key only when used: old hashes hold)
        point["compression_ratio"], point["budget"] = ratio, None
    if not budget_matters(cfg):
        point["budget"] = None
        point.pop("compression_ratio", None)
    if cfg.get("profile"):  # a key only when profiling: accuracy points keep their hashes
        point["profile"] = OmegaConf.to_container(cfg.profiler, resolve=True)
    data_file = cfg.task.get("path")
    if data_file and Path(data_file).is_file():  # an edited file is a new point, not a resume
        point["task_file_sha256"] = file_digest(Path(data_file).resolve())
    return point


@functools.lru_cache(maxsize=16)
def _digest(path: Path, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def file_digest(path: Path) -> str:
    stat = path.stat()
    return _digest(path, stat.st_size, stat.st_mtime_ns)


def budget_matters(cfg: DictConfig) -> bool:
    method = METHODS.get(cfg.method.name)
    return method is None or method.uses_budget


def _point_dir(*, _root_: DictConfig) -> str:
    point = point_identity(_root_)
    budget = str(_root_.budget).replace(".", "p") if point["budget"] is not None else "-"
    if point.get("compression_ratio") is not None:
        budget = "cr" + str(point["compression_ratio"]).replace(".", "p")
    mode = ("qa" if _root_.compress_question else "qagn") + ("-prof" if _root_.get("profile") else "")
    return f"{_root_.task.name}/{_root_.model.name}/{_root_.method.name}/b{budget}-{mode}-{point_hash(point)}"


OmegaConf.register_new_resolver("kvbench_point_dir", _point_dir, replace=True)
