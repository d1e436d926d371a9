"""`python -m kvbench`: one experiment point per Hydra job; `-m` sweeps.

A point is (model, task, method, budget, mode, engine settings, seed). Its run directory is derived from the
point itself (no timestamps), so re-running an interrupted command finds the records already written and
only computes the missing samples.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import hashlib
import logging
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import hydra
import numpy as np
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

import kvbench.conf
from kvbench.errors import KVBenchError
from kvbench.results import point_hash

if TYPE_CHECKING:
    from kvbench.engine import EngineConfig, PromptBuilder
    from kvbench.models import LoadedModel
    from kvbench.tasks.base import Sample

log = logging.getLogger("kvbench")


def _expose_launcher_plugin() -> None:
    """Make `hydra/launcher=grouped` discoverable from an editable checkout too.

    Hydra lists the modules of the `hydra_plugins` namespace package; setuptools' editable finder maps
    `hydra_plugins.kvbench_launcher` for imports but leaves the namespace's listing empty, so the checkout's
    folder is added to it (an installed wheel already puts the plugin there)."""
    import hydra_plugins

    folder = Path(__file__).resolve().parents[1] / "hydra_plugins"
    if (folder / "kvbench_launcher").is_dir() and str(folder) not in list(hydra_plugins.__path__):
        hydra_plugins.__path__.append(str(folder))


_expose_launcher_plugin()

CONF_DIR = str(Path(kvbench.conf.__file__).parent)
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
    from kvbench.methods import METHODS

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


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


_MODELS: dict[str, Any] = {}


def cached_model(model_cfg: DictConfig) -> "LoadedModel":
    """Models are loaded once per process: a local multirun reuses them across points."""
    from kvbench.models import load_model

    key = OmegaConf.to_yaml(model_cfg)
    if key not in _MODELS:
        _MODELS.clear()
        log.info("loading model %s (%s, %s)", model_cfg.name, model_cfg.dtype, model_cfg.device)
        _MODELS[key] = load_model(model_cfg)
    return _MODELS[key]


_SAMPLES: dict[tuple, list] = {}


def cached_samples(cfg: DictConfig, lm: "LoadedModel", builder: "PromptBuilder") -> list["Sample"]:
    """Samples depend on the task, the tokenizer (lengths are measured in it), the template and the seed, not on
    the method: a local sweep generates them once per process."""
    key = (OmegaConf.to_yaml(cfg.task), lm.name, cfg.seed, OmegaConf.to_yaml(cfg.engine))
    if key not in _SAMPLES:
        _SAMPLES.clear()
        try:
            task = instantiate(cfg.task, _convert_="all")
            if task.max_positions is None:
                task.max_positions = lm.max_positions
            log.info("%s: building samples (lengths measured in %s's tokenizer)", cfg.task.name, lm.name)
            start = time.perf_counter()
            _SAMPLES[key] = task.samples(builder.measure, seed=cfg.seed)
            log.info("%s: %d samples in %.1f s", cfg.task.name, len(_SAMPLES[key]), time.perf_counter() - start)
        except (ValueError, InstantiationException) as exc:  # a task's word on its settings
            log.debug("task %s failed", cfg.task.name, exc_info=True)
            cause = exc.__cause__ if isinstance(exc, InstantiationException) and exc.__cause__ else exc
            raise KVBenchError(f"task {cfg.task.name}: {cause}") from exc
    return _SAMPLES[key]


def _libc_trim() -> Any:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


_MALLOC_TRIM = _libc_trim()


def release_host_memory() -> None:
    """Hand freed KV tensors back to the OS between samples.

    glibc keeps freed heap pages of the cache's per-step reallocations, so without this a CPU run's RSS grew
    by ~300 MB per 4K-token SmolLM2 sample (measured: 1.5 -> 3.0 GiB over 6 samples; 1.24 GiB flat with it).
    """
    gc.collect()
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def validate(cfg: DictConfig) -> None:
    """Every top-level, engine and generic task setting, before anything runs: one line naming the setting and
    what it accepts. (Method parameters are checked where the method is built; model ones where it loads.)"""
    budget, ratio = cfg.budget, cfg.get("compression_ratio")
    if ratio is not None:
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio < 1:
            raise KVBenchError(f"compression_ratio must be a fraction of the tokens removed in [0, 1) (kvpress's "
                               f"convention), got {ratio!r}")
    elif isinstance(budget, bool) or not isinstance(budget, (int, float)) or budget <= 0:
        raise KVBenchError(f"budget must be a positive number of tokens per KV head (or a ratio in (0, 1)), got {budget!r}")
    elif isinstance(budget, float) and budget >= 1 and not budget.is_integer():
        raise KVBenchError(f"budget {budget} is neither a token count nor a ratio in (0, 1)")
    if not _is_int(cfg.seed):
        raise KVBenchError(f"seed must be an integer, got {cfg.seed!r}")
    for key in ("compress_question", "show_progress"):
        if not isinstance(cfg[key], bool):
            raise KVBenchError(f"{key} must be true or false, got {cfg[key]!r}")
    engine = cfg.engine
    for key in ("reuse_prefill", "nll", "chat_template", "topk_recall"):
        if key in engine and not isinstance(engine[key], bool):
            raise KVBenchError(f"engine.{key} must be true or false, got {engine[key]!r}")
    for key, low in (("snapshot_window", 1), ("snapshot_cache_mb", 0)):
        if key in engine and (not _is_int(engine[key]) or engine[key] < low):
            raise KVBenchError(f"engine.{key} must be an integer >= {low}, got {engine[key]!r}")
    if engine.get("system_prompt") is not None and not isinstance(engine.system_prompt, str):
        raise KVBenchError(f"engine.system_prompt must be text or null, got {engine.system_prompt!r}")
    num_samples = cfg.task.get("num_samples")
    if num_samples is not None and (not _is_int(num_samples) or num_samples < 1):
        raise KVBenchError(f"task.num_samples must be a positive integer (or null for every sample where the task "
                           f"allows it), got {num_samples!r}")
    seq_len = cfg.task.get("seq_len")
    if seq_len is not None and (not _is_int(seq_len) or seq_len < 1):
        raise KVBenchError(f"task.seq_len must be a positive number of tokens, got {seq_len!r}")


def check_length(cfg: DictConfig, lm: "LoadedModel") -> None:
    """A task longer than the model allows: say how long this model goes and the ways out."""
    seq_len = cfg.task.get("seq_len")
    if seq_len and seq_len > lm.max_positions:
        raise KVBenchError(
            f"task {cfg.task.name} asks for {seq_len} tokens (task.seq_len) but {lm.name} allows at most "
            f"{lm.max_positions} positions: run it with task.seq_len={lm.max_positions} or less (e.g. "
            f"task=ruler_4k / ruler_8k, or task.seq_len=4096), or on a long-context model "
            f"(model=llama3.1_8b_instruct, 128K)"
        )


@dataclass
class PreparedPoint:
    """An experiment point ready to run: its directory, identity, method, model, samples and record store."""

    cfg: DictConfig
    run_dir: Path
    point: dict[str, Any]
    phash: str
    method: Any
    lm: "LoadedModel"
    engine_cfg: "EngineConfig"
    samples: list["Sample"]
    store: Any
    point_fields: dict[str, Any]
    budget: Any

    def todo(self) -> list["Sample"]:
        done = self.store.completed_ids()
        return [s for s in self.samples if s.id not in done]

    def append(self, record: dict[str, Any]) -> None:
        record.update(point=self.point_fields, point_hash=self.phash, method_params=self.method.params())
        self.store.append(record)


def prepare_point(cfg: DictConfig, run_dir: Path) -> PreparedPoint:
    """Validate a point, load its model and samples, and set up its directory (manifest, config, records)."""
    from kvbench.engine import CompressionRatio, EngineConfig, PromptBuilder
    from kvbench.methods import build_method
    from kvbench.results import RecordStore, build_manifest, write_manifest

    validate(cfg)
    point = point_identity(cfg)
    phash = point_hash(point)
    seed_everything(cfg.seed)
    method_params = {k: v for k, v in OmegaConf.to_container(cfg.method, resolve=True).items() if k != "name"}
    method = build_method(cfg.method.name, **method_params)
    lm = cached_model(cfg.model)
    check_length(cfg, lm)
    engine_cfg = EngineConfig(compress_question=cfg.compress_question, **OmegaConf.to_container(cfg.engine))
    if cfg.profile:  # every sample's own prefill (the peaks are real) and no fidelity measurement in the timings
        engine_cfg.reuse_prefill, engine_cfg.topk_recall = False, False
    samples = cached_samples(cfg, lm, PromptBuilder(lm.tokenizer, engine_cfg.chat_template, engine_cfg.system_prompt))
    run_dir.mkdir(parents=True, exist_ok=True)
    store = RecordStore(run_dir)
    write_manifest(run_dir, build_manifest(cfg.seed, {"point_hash": phash, "point": point, "dtype": str(lm.dtype)}))
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    point_fields = {
        "model": lm.name,
        "task": cfg.task.name,
        "method": cfg.method.name,
        "budget": point["budget"],
        "compression_ratio": point.get("compression_ratio"),
        "seq_len": cfg.task.get("seq_len"),
        "compress_question": cfg.compress_question,
        "dtype": str(lm.dtype).replace("torch.", ""),
        "seed": cfg.seed,
    }
    budget = CompressionRatio(point["compression_ratio"]) if point.get("compression_ratio") is not None else cfg.budget
    return PreparedPoint(cfg, run_dir, point, phash, method, lm, engine_cfg, samples, store, point_fields, budget)


def run_point(cfg: DictConfig) -> dict[str, Any]:
    """Run (or resume) one experiment point and return its summary."""
    from kvbench.results import point_lock

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    with point_lock(run_dir):
        return _run_prepared(prepare_point(cfg, run_dir))


def _run_prepared(prepared: PreparedPoint) -> dict[str, Any]:
    from kvbench.results import summarize, write_summary

    cfg = prepared.cfg
    todo = prepared.todo()
    if len(todo) < len(prepared.samples):
        log.info("resuming %s: %d of %d samples already recorded", prepared.run_dir,
                 len(prepared.samples) - len(todo), len(prepared.samples))
    bar = tqdm(total=len(todo), desc=f"{cfg.method.name} b={prepared.budget} {cfg.task.name}", unit="sample",
               disable=not cfg.show_progress or not todo)
    batch = 1 if cfg.profile else max(1, int(prepared.engine_cfg.sample_batch))
    for start in range(0, len(todo), batch):
        for record in _run_rows(prepared, [(prepared, sample) for sample in todo[start:start + batch]]):
            if record.get("score") is not None:
                bar.set_postfix(score=f"{record['score']:.2f}")
        bar.update(len(todo[start:start + batch]))
        release_host_memory()
    bar.close()
    records = prepared.store.records()
    summary = summarize(records)
    summary.update(point=prepared.point_fields, point_hash=prepared.phash, run_dir=str(prepared.run_dir))
    suite = records[0].get("meta", {}).get("suite") if records else None
    if suite and suite.get("skipped"):  # e.g. RULER without its QA data: say the average is partial
        summary["suite_skipped"] = suite["skipped"]
    write_summary(prepared.run_dir, summary)
    _print_summary(summary)
    if cfg.get("logger") and cfg.logger.name == "wandb":
        from kvbench.wandb_logger import log_point

        log_point(cfg, summary, prepared.run_dir)
    return summary


def group_key(cfg: DictConfig) -> str | None:
    """Points with equal keys share a model, samples and engine settings, so their samples can decode as one
    batch (`run_grouped`); None for a point that runs alone (profiled points: their timings and peaks must be
    their own)."""
    if cfg.get("profile"):
        return None
    parts = [OmegaConf.to_yaml(cfg[k], resolve=True) for k in ("model", "task", "engine")]
    return "\n".join([*parts, str(cfg.compress_question), str(cfg.seed)])


def run_grouped(points: list[tuple[DictConfig, Path]], max_group: int) -> None:
    """Record the samples of several points that share a `group_key`, decoding each sample's points together.

    Per sample: every point still missing it joins one batch (at most `max_group` rows): its own prefill
    and compression (one shared dense prefill through the snapshots), then one batched decode and NLL
    (`engine.run_group`); each point's record is appended to its own store as soon as the sample is done, so
    an interrupted group resumes at the samples each point lacks. Points that fail to prepare are left to
    their own job, which reports the error.
    """
    from kvbench.results import point_lock

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
        if len(prepared) >= 2:
            _run_group_samples(prepared, max_group)


def _run_group_samples(prepared: list[PreparedPoint], max_group: int) -> None:
    samples = prepared[0].samples
    todo = {p.run_dir: {s.id for s in p.todo()} for p in prepared}
    pending = [s for s in samples if any(s.id in ids for ids in todo.values())]
    log.info("decoding %d points together, %d samples to run", len(prepared), len(pending))
    bar = tqdm(pending, desc=f"group of {len(prepared)} points, {prepared[0].cfg.task.name}", unit="sample",
               disable=not prepared[0].cfg.show_progress or not pending)
    for sample in bar:
        rows = [p for p in prepared if sample.id in todo[p.run_dir]]
        for start in range(0, len(rows), max_group):
            _run_rows(prepared[0], [(point, sample) for point in rows[start:start + max_group]])
        release_host_memory()


def _run_rows(first: PreparedPoint, rows: list[tuple[PreparedPoint, "Sample"]]) -> list[dict[str, Any]]:
    """Record (point, sample) rows that share a model and engine settings: one row through `_run_or_oom`,
    several decoded together (`engine.run_group`); a batch that runs out of memory is retried row by row.
    Each record is appended to its point's store as soon as it exists."""
    from kvbench.engine import run_group
    from kvbench.profiler import is_out_of_memory

    records = None
    if len(rows) > 1:
        try:
            records = run_group(first.lm, [(p.method, p.budget, sample) for p, sample in rows], first.engine_cfg)
        except Exception as exc:  # noqa: BLE001 - only allocation failures are caught, the rest re-raised
            if not is_out_of_memory(exc):
                raise
            log.warning("a batch of %d rows ran out of memory; running them one by one", len(rows))
            gc.collect()
    if records is None:
        records = [_run_or_oom(p.cfg, p.lm, p.method, p.budget, sample, p.engine_cfg) for p, sample in rows]
    for (point, _), record in zip(rows, records):
        point.append(record)
    return records


def _run_or_oom(cfg: DictConfig, lm: "LoadedModel", method: Any, budget: Any, sample: "Sample",
                engine_cfg: "EngineConfig") -> dict[str, Any]:
    """The sample's record (profiled when `profile=true`), or, when it runs out of memory, a record saying so:
    the point and the sweep go on (an efficiency sweep finds its OOM limit this way)."""
    from kvbench.engine import run_sample
    from kvbench.profiler import PhaseProfiler, combine_repeats, is_out_of_memory
    from kvbench.roofline import machine_peaks, roofline

    try:
        if not cfg.profile:
            return run_sample(lm, method, budget, sample, engine_cfg)
        runs = [run_sample(lm, method, budget, sample, engine_cfg,
                           profiler=PhaseProfiler(lm.device, cfg.profiler.warmup_steps))
                for _ in range(max(1, cfg.profiler.repeats))]
        record = combine_repeats(runs, cfg.profiler.warmup_steps)
        dtype = str(lm.dtype).replace("torch.", "")
        record["roofline"] = roofline(record, lm.model.config, dtype, machine_peaks(lm.device))
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


def _print_summary(summary: dict[str, Any]) -> None:
    point = summary["point"]
    budget = "-" if point["budget"] is None else point["budget"]
    score = "-" if summary["score"] is None else f"{summary['score']:.2f}"
    lines = [f"{point['method']} budget={budget} on {point['task']} ({point['model']}): "
             f"score {score} over {summary['n_samples']} samples"]
    if summary.get("suite_skipped"):
        lines.append(f"  (mean of {len(summary['tasks'])} subtasks; skipped for missing data: "
                     f"{', '.join(summary['suite_skipped'])})")
    if len(summary["tasks"]) > 1:
        for task, value in sorted(summary["tasks"].items()):
            lines.append(f"  {task:<32} {value['score']:7.2f}  (n={value['n']})")
    for key in ("nll", "kept_tokens_mean", "kv_bytes_after_prefill", "prefill_s", "decode_ms_per_token"):
        if summary["metrics"].get(key) is not None:
            lines.append(f"  {key:<32} {summary['metrics'][key]:.4g}")
    print("\n".join(lines), flush=True)


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def _hydra_entry(cfg: DictConfig) -> None:
    try:
        run_point(cfg)
    except KVBenchError as exc:
        print(f"kvbench: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)


GROUPS = ("model", "method", "task", "experiment", "logger")


def choices(group: str) -> list[str]:
    return sorted(p.stem for p in (Path(CONF_DIR) / group).glob("*.yaml"))


def check_group_overrides(argv: list[str]) -> None:
    """Name an unknown model/method/task/experiment in one line, before Hydra's search-path dump."""
    for arg in argv:
        key, sep, value = arg.lstrip("+~").partition("=")
        if not sep or key not in GROUPS:
            continue
        values = value.split(",") if "," in value and not value.startswith(("[", "choice(", "range(")) else [value]
        known = choices(key)
        for v in values:
            if v not in known:
                raise KVBenchError(f"unknown {key} {v!r}; available: {', '.join(known)}")


def _settings(group: str, name: str) -> list[str]:
    return [k for k in OmegaConf.load(Path(CONF_DIR) / group / f"{name}.yaml") if k not in ("name", "defaults")]


def _default_choice(group: str) -> str:
    for entry in OmegaConf.load(Path(CONF_DIR) / "config.yaml").defaults:
        if isinstance(entry, DictConfig) and group in entry:
            return entry[group]
    raise KeyError(group)


def check_settings(argv: list[str]) -> list[str]:
    """Name a `model.`, `method.` or `task.` setting that the chosen config lacks, in one line, and let
    `method.KEY=VALUE` set a parameter that several swept methods share.

    Hydra composes a sweep's base config with the default method (`full`), so a parameter it lacks
    (`-m method=snapkv,adakv method.pooling=avg`) would be refused before any job runs; `++method.KEY=VALUE`
    sets it in each job's method instead. With an experiment preset the chosen configs come from the preset,
    so the check is left to the jobs (a method then names an unknown parameter when it is built).
    """
    chosen: dict[str, list[str]] = {}
    for arg in argv:
        key, sep, value = arg.lstrip("+").partition("=")
        if key in ("model", "method", "task") and sep:
            chosen[key] = value.split(",") if "," in value and not value.startswith(("[", "choice(")) else [value]
    preset = any(arg.lstrip("+").startswith("experiment=") for arg in argv)
    out = []
    for arg in argv:
        key = arg.split("=", 1)[0]
        group, _, setting = key.partition(".")
        if "=" in arg and group in ("model", "method", "task") and setting and not preset:
            for name in chosen.get(group, [_default_choice(group)]):
                settings = _settings(group, name)
                if setting.split(".")[0] not in settings:
                    raise KVBenchError(f"{key} is not a setting of {group} {name} (its settings: "
                                       f"{', '.join(settings) or 'none'}); set it only where it exists")
        out.append("++" + arg if group == "method" and setting and "=" in arg and not arg.startswith(("+", "~"))
                   else arg)
    return out


def main() -> None:
    if sys.argv[1:2] == ["report"]:  # `kvbench report ...`: tables, figures and HTML from stored records
        from kvbench.report import main as report_main

        sys.exit(report_main(sys.argv[2:]))
    try:
        check_group_overrides(sys.argv[1:])
        sys.argv[1:] = check_settings(sys.argv[1:])
    except KVBenchError as exc:
        print(f"kvbench: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    _hydra_entry()


if __name__ == "__main__":
    main()
