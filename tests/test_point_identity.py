"""A point's identity is what decides its numbers: the dtype and device kind it resolves to (not the word
`auto`), a data file's content (not its path); points stored under the older hashes resume only where their
records match what this run would compute."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from kvbench import models
from kvbench.results.store import point_hash
from kvbench.run.identity import _point_dir, point_dir_name, point_identity, written_point_identity


def config(results_dir: Path, dtype: str = "auto", path: str | None = None) -> OmegaConf:
    task = {"name": "custom", "path": path} if path else {"name": "ruler_niah_single_1", "seq_len": 1024}
    return OmegaConf.create({
        "model": {"name": "smollm2_135m", "dtype": dtype, "device": "auto"}, "task": task,
        "method": {"name": "snapkv", "window": 32}, "budget": 64, "compress_question": True,
        "engine": {"nll": True}, "seed": 0, "results_dir": str(results_dir)})


@pytest.fixture(params=[True, False], ids=["native-bf16", "no-bf16"])
def cpu_bf16(request, monkeypatch):
    """Force what `auto` resolves to on this CPU (CUDA absent)."""
    monkeypatch.setattr(models, "fast_cpu_bfloat16", lambda: request.param)
    monkeypatch.setattr(models.torch.cuda, "is_available", lambda: False)
    return request.param


def test_auto_is_the_point_of_the_dtype_it_resolves_to(tmp_path, cpu_bf16):
    resolved = "bfloat16" if cpu_bf16 else "float32"
    other = "float32" if cpu_bf16 else "bfloat16"
    auto = point_identity(config(tmp_path, "auto"))
    assert auto == point_identity(config(tmp_path, resolved))
    assert auto != point_identity(config(tmp_path, other))
    assert auto["model"]["dtype"] == resolved and auto["model"]["device"] == "cpu"


def test_auto_names_different_points_where_it_resolves_differently(tmp_path, monkeypatch):
    monkeypatch.setattr(models.torch.cuda, "is_available", lambda: False)
    names = set()
    for native in (True, False):
        monkeypatch.setattr(models, "fast_cpu_bfloat16", lambda native=native: native)
        names.add(_point_dir(_root_=config(tmp_path, "auto")))
    assert len(names) == 2


def write_legacy_point(results_dir: Path, cfg, dtype: str, gpus: list | None = None) -> Path:
    run_dir = results_dir / point_dir_name(cfg, written_point_identity(cfg))
    run_dir.mkdir(parents=True)
    (run_dir / "manifest.json").write_text(json.dumps({"point": written_point_identity(cfg), "gpus": gpus or []}))
    (run_dir / "records.jsonl").write_text(json.dumps({"sample_id": "s0", "point": {"dtype": dtype}}) + "\n")
    return run_dir


def test_a_legacy_point_resumes_where_its_records_match_this_run(tmp_path, cpu_bf16):
    cfg = config(tmp_path, "auto")
    resolved = "bfloat16" if cpu_bf16 else "float32"
    legacy = write_legacy_point(tmp_path, cfg, resolved)
    assert _point_dir(_root_=cfg) == str(legacy.relative_to(tmp_path))


def test_a_legacy_point_of_another_dtype_is_not_resumed(tmp_path, cpu_bf16, caplog):
    cfg = config(tmp_path, "auto")
    other = "float32" if cpu_bf16 else "bfloat16"
    legacy = write_legacy_point(tmp_path, cfg, other)
    with caplog.at_level("WARNING", logger="kvbench"):
        name = _point_dir(_root_=cfg)
    assert name != str(legacy.relative_to(tmp_path)) and name == point_dir_name(cfg, point_identity(cfg))
    assert "starts its own point" in caplog.text


def test_a_legacy_point_computed_on_a_gpu_is_not_resumed_on_a_cpu(tmp_path, cpu_bf16):
    cfg = config(tmp_path, "auto")
    legacy = write_legacy_point(tmp_path, cfg, "bfloat16" if cpu_bf16 else "float32", gpus=[{"name": "H100"}])
    assert _point_dir(_root_=cfg) != str(legacy.relative_to(tmp_path))


def test_the_same_data_file_through_two_paths_is_one_point(tmp_path, monkeypatch):
    data = tmp_path / "data" / "samples.jsonl"
    data.parent.mkdir()
    data.write_text('{"context": "c", "question": "q", "answers": ["a"]}\n')
    (tmp_path / "link.jsonl").symlink_to(data)
    monkeypatch.chdir(tmp_path / "data")
    paths = [str(data), "samples.jsonl", "../data/samples.jsonl", str(tmp_path / "link.jsonl")]
    hashes = {point_hash(point_identity(config(tmp_path, "float32", p))) for p in paths}
    assert len(hashes) == 1
    data.write_text('{"context": "edited", "question": "q", "answers": ["a"]}\n')
    os.utime(data, ns=(1, 1))  # a new mtime even on coarse-clock filesystems
    assert point_hash(point_identity(config(tmp_path, "float32", str(data)))) not in hashes


def test_a_token_budget_written_as_a_float_is_the_integer_point(tmp_path):
    """`budget=1e3` (YAML's float 1000.0) is the point of `budget=1000`: one directory, one hash, integer
    budget in the records; it was a second point, `b1000p0`, of the same settings."""
    names = set()
    for written in (64, 64.0, 6.4e1):
        cfg = config(tmp_path, "float32")
        cfg.budget = written
        point = point_identity(cfg)
        assert point["budget"] == 64 and isinstance(point["budget"], int)
        names.add(point_dir_name(cfg, point))
    assert len(names) == 1 and "/b64-qa-" in names.pop()
    cfg = config(tmp_path, "float32")
    cfg.budget = 0.25  # a ratio stays a ratio
    assert point_identity(cfg)["budget"] == 0.25


def test_a_directory_holding_another_points_records_is_refused_and_left_as_it_was(tmp_path):
    """A Hydra output directory not named by kvbench (`hydra.sweep.subdir=x`, reused by a second point) held
    the first point's records, and the second point resumed them as its own: its summary gave budget 128 the
    64-token point's kept tokens and score. The second point is refused before its manifest is written."""
    from kvbench.config.paths import compose_config
    from kvbench.core.errors import KVBenchError
    from kvbench.run.prepare import prepare_point

    cfg = compose_config(["model=tiny_llama", "task=niah", "task.num_samples=1", "task.seq_len=2048",
                          "task.depths=[50]", f"results_dir={tmp_path}"])
    run_dir = tmp_path / "x"
    run_dir.mkdir()
    line = json.dumps({"sample_id": "niah-512-50-0", "point_hash": "0123456789ab", "score": 1.0}) + "\n"
    (run_dir / "records.jsonl").write_text(line)
    with pytest.raises(KVBenchError, match=r"x holds records of another point \(0123456789ab\), not of this one"):
        prepare_point(cfg, run_dir)
    assert (run_dir / "records.jsonl").read_text() == line
    assert not (run_dir / "manifest.json").exists() and not (run_dir / "config.yaml").exists()
