"""A point's identity: what decides its numbers, hashed into its directory name (the `kvbench_point_dir`
resolver Hydra's run and sweep directories use).

The identity holds the dtype and device kind a run resolves to (`model.dtype=auto` on a CPU with native
bfloat16 is the point `model.dtype=bfloat16`), and a custom data file's content, not the path it was reached by.
Points stored before that rule were hashed with the settings as written (`auto`, the path given:
`written_point_identity`); they are still resumed where their records were computed in the dtype and on the
device kind this run resolves to.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from kvbench.core.budget import canonical_budget
from kvbench.core.errors import KVBenchError
from kvbench.engine.config import point_samples
from kvbench.methods import METHODS
from kvbench.results.manifest import MANIFEST_FILE
from kvbench.results.store import load_records, point_hash

log = logging.getLogger("kvbench")

# The config sections and settings a point's identity hashes (config names, not the fields records show:
# results.collect.POINT_FIELDS); changing the set changes every point hash.
POINT_KEYS = ("model", "task", "method", "budget", "compress_question", "engine", "seed")


# Engine settings that change speed or memory bookkeeping but never a prediction.
# batch_rows changes no bit (kvbench.engine.invariance): records say how many rows shared a step
# (`decode_batched_rows`). row_block, like compile, names the decode path that ran: records say `decode_row_block`.
# sampling: what it decides is the `decoding` key below, present only on sampled points.
NON_IDENTITY_ENGINE_KEYS = ("reuse_prefill", "snapshot_window", "snapshot_cache_mb", "topk_recall", "sample_batch",
                            "batch_rows", "row_block", "compile", "sampling")


def point_identity(cfg: DictConfig) -> dict[str, Any]:
    """The settings that decide a point's numbers, as this machine resolves them (hashed into its directory)."""
    point = written_point_identity(cfg)
    from kvbench.models import resolved_precision  # torch and transformers: only once a point runs

    point["model"].update(resolved_precision(cfg.model))
    if resolved_decode_path(cfg) == "compiled":  # a key only when compiled: eager points keep their hashes
        point["engine"]["decode_path"] = "compiled"
    if "task_file_sha256" in point:  # the content is the identity, not the path it was reached by
        point["task"].pop("path", None)
    return point


def resolved_decode_path(cfg: DictConfig) -> str:
    """`compiled` where `engine.compile` asks for the compiled decode step on the device this run resolves to and
    the method allows it (`Method.static_decode_blocker`), else `eager`: compiled records are their own points
    (different kernels round differently), and each record says which path it ran (`decode_path`)."""
    return decode_path_choice(cfg)[0]


def decode_path_choice(cfg: DictConfig) -> tuple[str, str | None]:
    """The decode path (`resolved_decode_path`) and, where `engine.compile` asks for the compiled step but the
    point decodes eagerly, why (the reason its records carry as `decode_path_reason`); None otherwise."""
    from kvbench.engine.compiled import SHARDED_REASON, wants_compile
    from kvbench.engine.sample import STAGE_TIMED_REASON
    from kvbench.methods import build_method, method_parameters
    from kvbench.models import resolve_device

    setting = cfg.engine.get("compile", "auto")
    if setting not in ("auto", True, False) or not wants_compile(setting, resolve_device(cfg.model.device)):
        return "eager", None
    if cfg.model.get("device_map") is not None:
        return "eager", SHARDED_REASON
    if cfg.get("profile") and cfg.get("profiler", {}).get("stages"):
        return "eager", STAGE_TIMED_REASON
    try:
        method = build_method(cfg.method.name, **method_parameters(cfg.method))
    except KVBenchError:  # a bad method setting is reported when the point is prepared
        return "eager", None
    blocker = method.static_decode_blocker()
    return ("eager", blocker) if blocker is not None else ("compiled", None)


def written_point_identity(cfg: DictConfig) -> dict[str, Any]:
    """The identity with the settings as written (`auto`, the data file's path beside its digest): how points
    were hashed before issue 25, so points stored then are found and resumed; and what a report compares a
    preset's points by, since the machine that reports cannot know what `auto` resolved to where they ran."""
    point = {k: OmegaConf.to_container(cfg[k], resolve=True) if isinstance(cfg[k], DictConfig) else cfg[k]
             for k in POINT_KEYS}
    point["engine"] = {k: v for k, v in point["engine"].items() if k not in NON_IDENTITY_ENGINE_KEYS}
    if point["engine"].get("prefill_attention", "dense") == "dense":  # keys only when sparse: old hashes hold
        point["engine"].pop("prefill_attention", None)
        point["engine"].pop("minference", None)
    if point_samples(cfg.engine, cfg.task):  # a key only when sampled: greedy points keep their hashes
        point["engine"]["decoding"] = "sampled"
    # a null method parameter means "the method's default behaviour": a point from before the parameter
    # existed is the same point
    point["method"] = {k: v for k, v in point["method"].items() if v is not None}
    # plain weights on one device (issue 47's defaults) are how every point before them ran: the same point
    if point["model"].get("quantization", "none") in ("none", None):
        point["model"].pop("quantization", None)
    if point["model"].get("device_map") is None:
        point["model"].pop("device_map", None)
    point["budget"] = canonical_budget(point["budget"])
    ratio = cfg.get("compression_ratio")
    if ratio is not None:  # kvpress's convention replaces the budget (a new key only when used: old hashes hold)
        point["compression_ratio"], point["budget"] = ratio, None
    if not budget_matters(cfg):
        point["budget"] = None
        point.pop("compression_ratio", None)
    if cfg.get("profile"):  # a key only when profiling: accuracy points keep their hashes
        point["profile"] = OmegaConf.to_container(cfg.profiler, resolve=True)
        if not point["profile"].get("stages"):  # stage timing a key only when on: profiled points keep theirs
            point["profile"].pop("stages", None)
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


def point_dir_name(cfg: DictConfig, point: dict[str, Any]) -> str:
    """`<task>/<model>/<method>/b<budget>-<mode>-<hash>`: the point's directory under `results_dir`."""
    budget = str(point["budget"]).replace(".", "p") if point["budget"] is not None else "-"
    if point.get("compression_ratio") is not None:
        budget = "cr" + str(point["compression_ratio"]).replace(".", "p")
    mode = ("qa" if cfg.compress_question else "qagn") + ("-prof" if cfg.get("profile") else "")
    return f"{cfg.task.name}/{cfg.model.name}/{cfg.method.name}/b{budget}-{mode}-{point_hash(point)}"


def stored_point_identity(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    """The identity `run_dir` was named with: the legacy one for a point stored before issue 25's rule."""
    point = point_identity(cfg)
    if not run_dir.name.endswith(point_hash(point)):
        legacy = written_point_identity(cfg)
        if run_dir.name.endswith(point_hash(legacy)):
            return legacy
    return point


def _legacy_dir_matches(run_dir: Path, precision: dict[str, str]) -> bool:
    """Whether a legacy point's records were computed in `precision` (dtype and device kind), so that resuming
    it mixes nothing. The device kind of a legacy point: the one it named, or for `auto` whether its manifest
    lists GPUs."""
    try:
        manifest = json.loads((run_dir / MANIFEST_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    named = str(manifest.get("point", {}).get("model", {}).get("device", "auto"))
    device = ("cuda" if manifest.get("gpus") else "cpu") if named == "auto" else named.split(":")[0]
    dtypes = {r.get("point", {}).get("dtype") for r in load_records(run_dir)} or {precision["dtype"]}
    return device == precision["device"] and dtypes == {precision["dtype"]}


def _point_dir(*, _root_: DictConfig) -> str:
    point = point_identity(_root_)
    name = point_dir_name(_root_, point)
    root = Path(str(_root_.results_dir))
    if not (root / name).exists():
        legacy = point_dir_name(_root_, written_point_identity(_root_))
        if legacy != name and (root / legacy).is_dir():
            precision = {k: point["model"][k] for k in ("dtype", "device")}
            if _legacy_dir_matches(root / legacy, precision):
                return legacy
            log.warning("%s holds records computed in another dtype or on another device kind than this run's "
                        "(%s on %s): this run starts its own point %s", root / legacy, precision["dtype"],
                        precision["device"], root / name)
    return name


OmegaConf.register_new_resolver("kvbench_point_dir", _point_dir, replace=True)
