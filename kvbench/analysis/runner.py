"""Running one claim on a composed config: its directory, its per-sample records (resumable), its verdict and
its figure.

A claim's directory is derived from what it measures, like a point's: `<results_dir>/<claim>/<model>/
<task>-<seq_len>-<hash>`, the hash over the claim's parameters, the model config, the task config, the
prompt template settings and the seed (not the sample count: asking for more samples resumes). It holds
`measurements.jsonl` (one record per sample with the raw measurements, appended as each finishes),
`verdict.json`, the figure as `<claim>.png` and `.pdf`, `manifest.json` (versions, git sha, hardware) and
`config.yaml`. A claim without samples (a worked example) lives in `<results_dir>/<claim>/<hash>`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

import kvbench.analysis.claims  # noqa: F401 - registers every claim
from kvbench.analysis.base import Claim, registered, verdict
from kvbench.analysis.figures import save
from kvbench.analysis.trace import capture
from kvbench.config.validate import check_length
from kvbench.core.errors import KVBenchError
from kvbench.engine.prompt import PromptBuilder, fit_to_model
from kvbench.results.manifest import build_manifest, write_manifest
from kvbench.results.store import MEASUREMENTS_FILE, VERDICT_FILE, RecordStore, _atomic_write_json, point_hash
from kvbench.run.caches import cached_model, cached_samples, release_host_memory, seed_everything
from kvbench.run.prepare import unrecorded
from kvbench.run.progress import SampleProgress, duration

log = logging.getLogger("kvbench")


def claims() -> dict[str, type[Claim]]:
    """Every claim by name."""
    return registered()


def build_claim(name: str, params: dict[str, Any]) -> Claim:
    """The claim `name` with its parameters; unknown names and parameters are one clear error."""
    known = claims()
    if name not in known:
        raise KVBenchError(f"unknown claim {name!r}; claims: {', '.join(known)} (kvbench analyze --list)")
    fields = {f.name for f in dataclasses.fields(known[name])}
    unknown = sorted(set(params) - fields)
    if unknown:
        raise KVBenchError(f"claim {name}: unknown parameter(s) {', '.join(unknown)}; its parameters: "
                           f"{', '.join(sorted(fields))}")
    return known[name](**params)


def run_claim(cfg: DictConfig, name: str) -> dict[str, Any]:
    """Measure claim `name` on the config's model and task samples (resuming), and write its verdict and figure."""
    given = cfg.params.get(name) if cfg.params else None
    params = OmegaConf.to_container(given, resolve=True) if given is not None else {}
    claim = build_claim(name, params)
    seed_everything(cfg.seed)
    start = time.perf_counter()
    if not claim.needs_samples:
        run_dir = Path(cfg.results_dir) / name / point_hash({"claim": name, "params": dataclasses.asdict(claim)})
        store = _open(run_dir, cfg, {"claim": name, "params": dataclasses.asdict(claim)})
        if not store.records():
            store.append(claim.measure_once())
        return _conclude(claim, store.records(), run_dir, cfg, {}, time.perf_counter() - start)
    lm = cached_model(cfg.model)
    check_length(cfg, lm)
    builder = PromptBuilder(lm.tokenizer, cfg.engine.chat_template, cfg.engine.system_prompt)
    samples = cached_samples(cfg, lm, builder)[: cfg.num_samples]
    task = OmegaConf.to_container(cfg.task, resolve=True)
    task.pop("num_samples", None)  # more samples later extend these records
    identity = {"claim": name, "params": dataclasses.asdict(claim), "model": OmegaConf.to_container(cfg.model),
                "task": task, "engine": OmegaConf.to_container(cfg.engine), "seed": cfg.seed}
    seq_len = cfg.task.get("seq_len")
    run_dir = (Path(cfg.results_dir) / name / lm.name.replace("/", "--")
               / f"{cfg.task.name}-{seq_len or 'native'}-{point_hash(identity)}")
    store = _open(run_dir, cfg, identity)
    todo = unrecorded(store, samples, run_dir, cfg.task.name)
    if len(todo) < len(samples):
        log.info("resuming %s: %d of %d samples already measured", run_dir, len(samples) - len(todo), len(samples))
    bar = SampleProgress(len(todo), name, cfg.show_progress)
    for sample in todo:
        context, question = builder.first_turn(sample)
        ids = fit_to_model(lm, sample, context, question) + question  # LongBench's middle truncation, as a run
        trace = capture(lm, ids, claim.new_tokens)
        try:
            record = claim.measure(trace, sample, seed=_sample_seed(cfg.seed, sample.id))
        except ValueError as err:  # the claim's word on its parameters for this prompt
            raise KVBenchError(f"claim {name} on sample {sample.id}: {err}") from err
        record.update(sample_id=sample.id, sample_digest=sample.digest(), claim=name, prompt_tokens=len(ids),
                      generated_tokens=len(trace.generated))
        store.append(record)
        del trace
        release_host_memory()
        bar.update(1, effect=f"{record['effect']:.3f}")
    bar.close()
    wanted = {s.id for s in samples}
    records = [r for r in store.records() if r["sample_id"] in wanted]
    context = {"model": lm.name, "dtype": str(lm.dtype).replace("torch.", ""), "task": cfg.task.name,
               "seq_len": seq_len}
    return _conclude(claim, records, run_dir, cfg, context, time.perf_counter() - start)


def _open(run_dir: Path, cfg: DictConfig, identity: dict[str, Any]) -> RecordStore:
    store = RecordStore(run_dir, MEASUREMENTS_FILE)
    write_manifest(run_dir, build_manifest(cfg.seed, {"point_hash": point_hash(identity), "point": identity}))
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    return store


def _sample_seed(seed: int, sample_id: str) -> int:
    """The run's seed mixed with the sample's id: each sample draws its own positions, the same on every run."""
    return (seed * 1_000_003 + int(hashlib.sha256(sample_id.encode()).hexdigest()[:8], 16)) % 2**31


def _conclude(claim: Claim, records: list[dict[str, Any]], run_dir: Path, cfg: DictConfig,
              context: dict[str, Any], seconds: float) -> dict[str, Any]:
    if not records:
        raise KVBenchError(f"claim {claim.name}: no samples to measure (task {cfg.task.name} gave none)")
    result = {**verdict(claim, records, cfg.seed), **context, "run_dir": str(run_dir),
              "figure": f"{claim.name}.png", "wall_s": round(seconds, 1)}
    _atomic_write_json(run_dir / VERDICT_FILE, result)
    save(claim.figure(records), run_dir, claim.name)
    log.info("%s: %s in %s", claim.name, result["verdict"], duration(seconds))
    return result
