"""The sample's generator (`Step.generator`): what a stochastic method draws is a function of the run's seed and
the sample's id only. Random eviction (`method=random`, kvpress's RandomPress) is the method that draws."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import torch
from conftest import random_ids
from test_engine import kv_sample

from kvbench.engine.config import EngineConfig
from kvbench.engine.sample import run_group, run_sample, sample_generator
from kvbench.engine.session import Session
from kvbench.methods import build_method


def outcome(record: dict) -> tuple:
    """What a record's draws decide: each turn's prediction and NLL (bitwise)."""
    return [t["prediction"] for t in record["turns"]], [t["nll"] for t in record["turns"]]


def kept_positions(lm, generator: torch.Generator, ids: list[int], **params) -> list[torch.Tensor]:
    session = Session(lm, build_method("random", **params), 40, generator=generator)
    logits, _ = session.prefill(ids, compress=True)
    for _ in range(4):
        logits = session.step(int(logits.argmax()))
    return [layer.positions.clone() for layer in session.cache.layers]


def test_the_draws_follow_the_seed_and_the_sample_id_only(tiny_llama):
    ids = random_ids(200, seed=3)
    for params in ({}, {"decode_every": 1}, {"block_size": 64}):
        first = kept_positions(tiny_llama, sample_generator(42, "sample-a"), ids, **params)
        again = kept_positions(tiny_llama, sample_generator(42, "sample-a"), ids, **params)
        other_sample = kept_positions(tiny_llama, sample_generator(42, "sample-b"), ids, **params)
        other_seed = kept_positions(tiny_llama, sample_generator(7, "sample-a"), ids, **params)
        assert all(torch.equal(a, b) for a, b in zip(first, again)), params
        assert not all(torch.equal(a, b) for a, b in zip(first, other_sample)), params
        assert not all(torch.equal(a, b) for a, b in zip(first, other_seed)), params


def test_two_samples_of_the_same_length_draw_differently_and_a_rerun_draws_the_same(tiny_llama):
    """Through the engine: the samples differ in their id alone (the same prompt, so the same length)."""
    sample = kv_sample(1)
    twin = dataclasses.replace(sample, id="kv-1")
    method = build_method("random", decode_every=1)
    records = [run_sample(tiny_llama, method, 24, s, EngineConfig(seed=42)) for s in (sample, sample, twin)]
    assert outcome(records[0]) == outcome(records[1])
    assert outcome(records[0])[1] != outcome(records[2])[1]


def test_a_group_draws_what_each_of_its_rows_draws_alone(tiny_llama):
    """Rows of one sample (a grouped sweep's points) and of several samples (engine.sample_batch)."""
    sample, twin = kv_sample(2), dataclasses.replace(kv_sample(2), id="kv-1")
    rows = [(build_method("random"), 24, sample), (build_method("random", decode_every=1), 32, sample),
            (build_method("snapkv", window=8), 24, sample), (build_method("random", decode_every=1), 32, twin)]
    cfg = EngineConfig(seed=5)
    together = run_group(tiny_llama, rows, cfg)
    for (method, budget, s), grouped in zip(rows, together):
        alone = run_sample(tiny_llama, method, budget, s, cfg)
        assert outcome(alone) == outcome(grouped), method.name


def test_random_eviction_decodes_eagerly_when_it_draws_at_every_step():
    assert build_method("random").static_decode_blocker() is None  # decoding is dense: it may compile
    assert "generator" in build_method("random", decode_every=1).static_decode_blocker()


def _draws(root: Path) -> dict[str, tuple]:
    """sample id -> (predictions, NLL) of random eviction's records under `root`."""
    out = {}
    for path in root.rglob("records.jsonl"):
        for record in map(json.loads, path.read_text().splitlines()):
            if record["point"]["method"] == "random" and record["point"]["budget"] == 24:
                out[record["sample_id"]] = outcome(record)
    return out


def test_a_grouped_sweep_draws_what_a_lone_run_and_a_rerun_draw(tmp_path):
    """The grouped launcher (the local multirun's default) decodes a sample's points together; the point of
    random eviction records what it records alone, and what it records again in a fresh directory."""
    args = ["model=tiny_llama", "task=twostage_retr", "task.num_samples=2", "task.max_new_tokens=6",
            "show_progress=false"]

    def kvbench(*extra: str) -> subprocess.CompletedProcess:
        multirun = ["-m"] if any("," in arg for arg in extra) else []
        result = subprocess.run([sys.executable, "-m", "kvbench", *multirun, *args, *extra], cwd=tmp_path,
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        return result

    kvbench("method=random", "budget=24", f"results_dir={tmp_path / 'lone'}")
    grouped = kvbench("method=random,snapkv", "budget=24,32", f"results_dir={tmp_path / 'grouped'}")
    kvbench("method=random", "budget=24", f"results_dir={tmp_path / 'rerun'}")
    assert "decoding 4 points together" in grouped.stdout + grouped.stderr
    lone = _draws(tmp_path / "lone")
    assert len(lone) == 2
    assert _draws(tmp_path / "grouped") == lone == _draws(tmp_path / "rerun")
