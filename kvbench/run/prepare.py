"""A point made ready to run: validated, its model and samples loaded, its directory and record store set up."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from kvbench.config.validate import check_length, validate
from kvbench.core.budget import CompressionRatio, canonical_budget, is_relative
from kvbench.core.errors import KVBenchError
from kvbench.engine.config import EngineConfig
from kvbench.engine.prompt import PromptBuilder
from kvbench.engine.snapshots import PrefillSnapshots
from kvbench.kernels.decode_attention import decode_attention_kind
from kvbench.methods import build_method, method_parameters
from kvbench.models import LoadedModel
from kvbench.results.manifest import build_manifest, write_manifest
from kvbench.results.store import RecordStore, point_hash
from kvbench.run.caches import cached_model, cached_samples, prefill_snapshots, seed_everything
from kvbench.run.identity import decode_path_choice, stored_point_identity
from kvbench.tasks.base import Sample

log = logging.getLogger("kvbench")


@dataclass
class PreparedPoint:
    """An experiment point ready to run: its directory, identity, method, model, samples and record store, and
    the process's prefill snapshots it shares with the other points."""

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
    snapshots: PrefillSnapshots | None  # None: no reuse (engine.reuse_prefill off, profiled points)

    def todo(self) -> list["Sample"]:
        return unrecorded(self.store, self.samples, self.run_dir, self.cfg.task.name)

    def append(self, record: dict[str, Any]) -> None:
        sample = next(s for s in self.samples if s.id == record["sample_id"])
        record.update(point=self.point_fields, point_hash=self.phash, method_params=self.method.params(),
                      sample_digest=sample.digest())
        self.store.append(record)


def unrecorded(store: RecordStore, samples: list["Sample"], run_dir: Path, task: str) -> list["Sample"]:
    """The samples without a record in `store`. A record of a sample that is now generated differently (a
    task's generator changed since) is refused: resuming would mix two datasets in one directory."""
    recorded = store.recorded_digests()
    stale = [s.id for s in samples if recorded.get(s.id) not in (None, s.digest())]
    if stale:
        raise KVBenchError(
            f"{run_dir} holds records of {len(stale)} sample(s) ({', '.join(stale[:3])}"
            f"{', ...' if len(stale) > 3 else ''}) that this version of task {task} generates "
            "differently: move that directory away (or set another results_dir) to compute the point again")
    return [s for s in samples if s.id not in recorded]


def check_own_records(store: RecordStore, run_dir: Path, phash: str) -> None:
    """A directory holding another point's records is not resumed: its samples would count as this point's
    (reached by a Hydra output directory not named by kvbench, e.g. `hydra.sweep.subdir=${hydra.job.num}`
    from an earlier sweep). Before the manifest is written, so that nothing there changes."""
    others = sorted({rec.get("point_hash") for rec in store.records()} - {None, phash})
    if others:
        raise KVBenchError(f"{run_dir} holds records of another point ({', '.join(others)}), not of this one "
                           f"({phash}): kvbench names each point's directory after its settings (under results_dir); "
                           "leave Hydra's output directories (hydra.run.dir, hydra.sweep.subdir) to it")


def prepare_point(cfg: DictConfig, run_dir: Path) -> PreparedPoint:
    """Validate a point, load its model and samples, and set up its directory (manifest, config, records)."""
    validate(cfg)
    point = stored_point_identity(cfg, run_dir)
    phash = point_hash(point)
    seed_everything(cfg.seed)
    method = build_method(cfg.method.name, **method_parameters(cfg.method))
    lm = cached_model(cfg.model)
    check_length(cfg, lm)
    engine_cfg = EngineConfig(compress_question=cfg.compress_question, seed=cfg.seed,
                              **OmegaConf.to_container(cfg.engine))
    if cfg.profile:  # every sample's own prefill (the peaks are real) and no fidelity measurement in the timings
        engine_cfg.reuse_prefill, engine_cfg.topk_recall = False, False
    samples = cached_samples(cfg, lm, PromptBuilder(lm.tokenizer, engine_cfg.chat_template, engine_cfg.system_prompt))
    if not samples:  # a point of no sample would be stored and reported as a score over 0 samples
        raise KVBenchError(f"task {cfg.task.name} gives no sample with these settings: nothing to run")
    run_dir.mkdir(parents=True, exist_ok=True)
    store = RecordStore(run_dir)
    check_own_records(store, run_dir, phash)
    write_manifest(run_dir, build_manifest(cfg.seed, {"point_hash": phash, "point": point, "dtype": str(lm.dtype),
                                                 "decode_attention": decode_attention_kind(lm.dtype, lm.device)}))
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
        **lm.record_fields(),  # quantisation and device map, when not the plain single-device model
        # the prompt's first forward, when not dense (MInference's sparse prefill)
        **({"prefill_attention": engine_cfg.prefill_attention} if engine_cfg.prefill_attention != "dense" else {}),
    }
    ratio = point.get("compression_ratio")
    budget = CompressionRatio(ratio) if ratio is not None else canonical_budget(cfg.budget)
    path, eager_reason = decode_path_choice(cfg)
    if eager_reason is not None:  # asked for (engine.compile, or auto on CUDA) and not given: one line per point
        log.warning("kvbench: %s decodes eagerly although engine.compile=%s asks for the compiled step: %s",
                    cfg.method.name, str(cfg.engine.get("compile", "auto")).lower(), eager_reason)
    if path == "compiled" and method.selects and is_relative(budget) and len(samples) > 1:
        # the tokens a step selects (t / 2) are a shape of the compiled graph, and t follows each sample's length
        log.warning("kvbench: %s with a ratio budget (%s) on the compiled decode step compiles a graph for each "
                    "prompt length (tens of seconds each on a GPU); a token budget shares one graph per capacity, "
                    "engine.compile=false compiles none", cfg.method.name, budget)
    snapshots = prefill_snapshots(engine_cfg.snapshot_cache_mb) if engine_cfg.reuse_prefill else None
    return PreparedPoint(cfg, run_dir, point, phash, method, lm, engine_cfg, samples, store, point_fields, budget,
                         snapshots)
