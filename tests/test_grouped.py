"""Grouped decoding: several caches in one batch give each row exactly its own attention, and a sweep's points
decoded together record what each point alone records."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import model_cfg, random_ids
from hydra.utils import instantiate
from omegaconf import OmegaConf

from kvbench.attention.dispatch import kvbench_attention
from kvbench.cache.batched import BatchedCache
from kvbench.engine.config import EngineConfig
from kvbench.engine.prompt import PromptBuilder
from kvbench.engine.sample import run_group, run_sample
from kvbench.engine.session import Session
from kvbench.methods import METHODS, build_method
from kvbench.models import load_model

CONF = Path(__file__).resolve().parents[1] / "kvbench" / "conf"


def assert_same_records(alone: dict, grouped: dict) -> None:
    assert [t["prediction"] for t in alone["turns"]] == [t["prediction"] for t in grouped["turns"]]
    assert [t["nll"] for t in alone["turns"]] == [t["nll"] for t in grouped["turns"]]  # bitwise
    for key in ("score", "kv_bytes_end", "kept_tokens_end_max", "eviction_events", "decode_read_bytes_per_step"):
        assert alone[key] == grouped[key], key


def _three_layouts(lm) -> list[Session]:
    """Caches of different lengths: full (uniform, 70 tokens), Ada-KV (ragged) and SnapKV (uniform, 30)."""
    sessions = []
    for method, params, budget, length, seed in (("full", {}, None, 70, 1), ("adakv", {"window": 8}, 40, 90, 2),
                                                 ("snapkv", {}, 30, 50, 3)):
        session = Session(lm, build_method(method, **params), budget)
        session.prefill(random_ids(length, seed=seed), compress=True)
        sessions.append(session)
    assert all(layer.is_ragged for layer in sessions[1].cache.layers)
    assert not any(layer.is_ragged for layer in sessions[2].cache.layers)
    return sessions


def test_batched_attention_equals_each_caches_own_attention(tiny):
    config = tiny.model.config
    heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    assert heads > kv_heads  # GQA
    sessions = _three_layouts(tiny)
    gen = torch.Generator().manual_seed(4)
    query = torch.randn(3, heads, 1, dim, generator=gen)
    keys, values = torch.randn(3, kv_heads, 1, dim, generator=gen), torch.randn(3, kv_heads, 1, dim, generator=gen)
    module = SimpleNamespace(layer_idx=0)
    alone = []
    for b, session in enumerate(sessions):
        twin = session.fork()
        key, _ = twin.cache.layers[0].update(keys[b:b + 1], values[b:b + 1])
        alone.append(kvbench_attention(module, query[b:b + 1], key, None, None, scaling=0.25,
                                       kvbench_steps=[twin.step_context()])[0])
    batched_layer = BatchedCache([s.cache for s in sessions]).layers[0]
    key, value = batched_layer.update(keys, values)
    together, _ = kvbench_attention(module, query, key, value, None, scaling=0.25,
                                    kvbench_steps=[s.step_context() for s in sessions])
    assert together.shape == (3, 1, heads, dim)
    for b in range(3):
        assert torch.equal(together[b:b + 1], alone[b])
    lengths = [sum(s.cache.layers[0].lengths()) for s in sessions]
    assert lengths == [71 * kv_heads, 41 * kv_heads, 31 * kv_heads]  # each cache got its own row


def _samples(lm, n: int = 2):
    task_cfg = OmegaConf.load(CONF / "task" / "twostage_retr.yaml")
    task_cfg.num_samples, task_cfg.max_new_tokens = n, 10
    task = instantiate(task_cfg, _convert_="all")
    task.max_positions = lm.max_positions
    return task.samples(PromptBuilder(lm.tokenizer).measure, seed=3)


# uniform, ragged, selection, decode-time eviction, two-stage, block-wise prefill, host rows (CTKVR, OmniKV)
GRID = [("full", {}, 64), ("adakv", {}, 48), ("exact_topk", {}, 32), ("snapkv", {"decode_every": 1}, 40),
        ("rocketkv", {}, 48), ("keydiff", {}, 48), ("ctkvr", {}, 32), ("omnikv", {"filter_layers": [0], "offload": True}, 16),
        # the seeds' baselines: per-head streaming, LSH sampling, low-rank keys, block memory, ANN retrieval
        ("duoattention", {"pattern": "tiny_llama"}, 24), ("magicpig", {"n_local": 8, "dense_layers": None}, 16),
        ("shadowkv", {"local_chunks": 1, "outlier_chunks": 2}, 16), ("infllm", {"memory_block_size": 8}, 48),
        ("retrieval_attention", {"n_init": 4, "n_local": 8}, 8),
        # the rest of the list: sinks and a window, pyramid budgets, accumulated scores, page and
        # reduced-dimension selection
        ("streamingllm", {}, 24), ("pyramidkv", {}, 40), ("h2o", {}, 40), ("quest", {}, 32), ("sparq", {}, 32),
        # a stochastic method: the sample's generator, drawn at the prompt's end and at every decode step
        ("random", {"decode_every": 1}, 32),
        # the rest of the registry (a point's records may not depend on its batch, whatever its method): Ada-KV's
        # pyramid, RocketKV's second stage alone and its multi-turn form, key norms, clustered keys, TOVA
        ("ada_pyramid", {}, 48), ("hsa", {}, 32), ("rocketkv_mt", {}, 48), ("keyl2norm", {}, 40),
        ("squeezed_attention", {"window": 8}, 32), ("tova", {"decode_every": 1}, 40)]


def test_the_grid_holds_every_registered_method():
    assert sorted({name for name, _, _ in GRID}) == sorted(METHODS)


def _grouped_vs_alone(lm, compress_question: bool, **engine) -> list[tuple[dict, dict]]:
    pairs = []
    for sample in _samples(lm):
        points = [(build_method(name, **params), budget) for name, params, budget in GRID]
        alone = [run_sample(lm, method, budget, sample, EngineConfig(compress_question=compress_question))
                 for method, budget in points]
        cfg = EngineConfig(compress_question=compress_question, **engine)
        grouped = run_group(lm, [(method, budget, sample) for method, budget in points], cfg)
        pairs += list(zip(alone, grouped))
    return pairs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("compress_question", [True, False])
@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen3"])
def test_grouped_points_record_what_each_point_records_alone(model, dtype, compress_question):
    """The default: a sample's points decode as rows of one batch (eager forwards padded to the row block), and
    each row's record is bitwise what the point records alone; the records say how many rows shared a step."""
    lm = load_model(model_cfg(model, dtype=dtype))
    for alone, grouped in _grouped_vs_alone(lm, compress_question):
        assert_same_records(alone, grouped)
        assert alone["decode_batched_rows"] == 1 and "decode_batch_reason" not in grouped
        assert grouped["decode_batched_rows"] > 1 and grouped["decode_row_block"] == 4


def test_rows_one_at_a_time_record_what_batched_rows_record(tiny):
    """`engine.batch_rows=1` (every row its own forward) and the default batch give the same bits."""
    one_at_a_time = _grouped_vs_alone(tiny, compress_question=False, batch_rows=1)
    batched = _grouped_vs_alone(tiny, compress_question=False)
    for (_, single), (_, together) in zip(one_at_a_time, batched):
        assert single["decode_batched_rows"] == 1 and together["decode_batched_rows"] > 1
        assert_same_records(single, together)
    # more points than `engine.batch_rows`: forwards of at most that many rows, the rest in another forward
    assert len(GRID) > EngineConfig().batch_rows
    assert max(together["decode_batched_rows"] for _, together in batched) == EngineConfig().batch_rows


def test_a_machine_whose_kernels_are_not_batch_invariant_decodes_one_row_at_a_time():
    """The probe (kvbench.engine.invariance) runs on the machine's kernels: a substituted output head whose rows
    depend on the other rows of its product fails it, and the group then decodes one row at a time, saying why."""
    lm = load_model(model_cfg("tiny_llama"))  # a copy of its own: the substituted kernel and the probe's answer
    plain = lm.model.lm_head.forward
    lm.model.lm_head.forward = lambda x: plain(x) + 1e-3 * x.mean(dim=0, keepdim=True).sum(-1, keepdim=True)
    sample = _samples(lm, n=1)[0]
    points = [(build_method(name, **params), budget) for name, params, budget in GRID[:3]]
    alone = [run_sample(lm, method, budget, sample, EngineConfig()) for method, budget in points]
    grouped = run_group(lm, [(method, budget, sample) for method, budget in points], EngineConfig())
    for a, g in zip(alone, grouped):
        assert "kernels are not batch-invariant for tiny_llama in float32" in g["decode_batch_reason"]
        assert g["decode_batched_rows"] == 1
        assert_same_records(a, g)


def test_compiled_points_step_alone_in_a_group_and_record_what_they_record_alone(tiny, monkeypatch):
    """`engine.compile=true`: a compiled decode loop is one graph per session, so its rows step alone while the
    group's eager rows (a method whose steps need the host) share forwards; every record is its point's alone."""
    from kvbench.engine import compiled

    monkeypatch.setattr(compiled, "BACKEND", "eager")  # dynamo's tracing without inductor's compile time
    sample = _samples(tiny, n=1)[0]
    points = [(build_method("quest"), 48), (build_method("snapkv", window=8), 40), (build_method("infllm"), 48),
              (build_method("ctkvr"), 32)]
    cfg = EngineConfig(compile=True)
    alone = [run_sample(tiny, method, budget, sample, cfg) for method, budget in points]
    grouped = run_group(tiny, [(method, budget, sample) for method, budget in points], cfg)
    assert [g["decode_path"] for g in grouped] == ["compiled", "compiled", "eager", "eager"]
    assert [g["decode_batched_rows"] for g in grouped] == [1, 1, 2, 2]
    assert "compiled rows step alone" in grouped[0]["decode_batch_reason"]
    for a, g in zip(alone, grouped):
        assert_same_records(a, g)


# issue 66's list: full, StreamingLLM, SnapKV, Ada-KV, PyramidKV, H2O, Quest, SparQ, RocketKV, Exact-TopK, an offload
SAMPLE_BATCH_METHODS = ("full", "streamingllm", "snapkv", "adakv", "pyramidkv", "h2o", "quest", "sparq", "rocketkv",
                        "exact_topk", "omnikv")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_several_samples_of_one_point_decode_together(dtype):
    """`engine.sample_batch=4`: four samples of one point as the rows of one batch, each record bitwise its own."""
    lm = load_model(model_cfg("tiny_llama", dtype=dtype))
    samples = _samples(lm, n=4)
    points = [(name, params, budget) for name, params, budget in GRID if name in SAMPLE_BATCH_METHODS]
    assert sorted(name for name, _, _ in points) == sorted(SAMPLE_BATCH_METHODS)
    for name, params, budget in points:
        method = build_method(name, **params)
        alone = [run_sample(lm, method, budget, s, EngineConfig()) for s in samples]
        together = run_group(lm, [(method, budget, s) for s in samples], EngineConfig(sample_batch=4))
        for a, g in zip(alone, together):
            assert a["sample_id"] == g["sample_id"] and g["decode_batched_rows"] == 4, name
            assert_same_records(a, g)


@pytest.mark.integration
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grouped_points_on_the_embedded_model(smollm2, dtype):
    lm = smollm2 if dtype == "float32" else load_model(model_cfg("smollm2_135m", device="cpu", dtype=dtype))
    sample = _samples(lm, n=1)[0]
    cfg = EngineConfig()
    points = [(build_method(name, **params), budget) for name, params, budget in GRID[:3]]
    alone = [run_sample(lm, method, budget, sample, cfg) for method, budget in points]
    grouped = run_group(lm, [(method, budget, sample) for method, budget in points], cfg)
    for a, g in zip(alone, grouped):
        assert_same_records(a, g)
        assert g["decode_batched_rows"] > 1 and "decode_batch_reason" not in g  # batched, not one row at a time


def _records(root: Path) -> dict[tuple[str, str], list[dict]]:
    out: dict[tuple[str, str], list[dict]] = {}
    for path in root.rglob("records.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            out.setdefault((str(path.parent.relative_to(root)), record["sample_id"]), []).append(record)
    return out


def _point_dirs(root: Path) -> list[Path]:
    """The point directories under `root` in the order the jobs run (method full before snapkv)."""
    return sorted((p.parent for p in root.rglob("records.jsonl")), key=lambda d: d.parent.name)


def test_the_grouped_phase_logs_as_the_jobs_do(tmp_path):
    """The lines a group writes (its samples, its progress) name kvbench's logger and level, as a job's lines do,
    not Hydra's launcher prefix; Hydra's own lines keep theirs. Each job then says its samples were recorded with
    its group (not that it resumes); a rerun has nothing to decode together and each job resumes."""
    result = subprocess.run([sys.executable, "-m", "kvbench", "-m", "model=tiny_llama", "task=twostage_retr",
                             "task.num_samples=1", "task.max_new_tokens=2", "method=full,snapkv", "budget=40",
                             "show_progress=false", f"results_dir={tmp_path}"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert any("[kvbench][INFO] - decoding 2 points together" in line for line in lines), lines
    assert not any("[HYDRA] decoding" in line or "[HYDRA] loading model" in line for line in lines), lines
    assert any("[HYDRA] Launching 2 jobs locally" in line for line in lines), lines
    assert not list(tmp_path.glob("*.log")), "the grouped phase writes no job's log file"
    said = [line.split(" - ", 1)[-1] for line in lines if "samples" in line and "[kvbench]" in line]
    assert [line for line in said if "recorded" in line] == [f"{d.name}: 1 of 1 samples recorded with its group"
                                                             for d in _point_dirs(tmp_path)], said
    again = subprocess.run(result.args, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert "decoding 2 points together" not in again.stdout and again.stdout.count("1 of 1 samples already recorded") == 2


def test_a_killed_grouped_multirun_resumes_without_loss_or_duplicates(tmp_path):
    args = ["-m", "model=tiny_llama", "task=twostage_retr", "task.num_samples=6", "task.max_new_tokens=8",
            "method=full,adakv,exact_topk", "budget=40", "show_progress=false"]
    killed, whole = tmp_path / "killed", tmp_path / "whole"
    proc = subprocess.Popen([sys.executable, "-m", "kvbench", *args, f"results_dir={killed}"], cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 240
    try:
        while time.time() < deadline and len(_records(killed)) < 6:  # two samples of three points
            time.sleep(0.1)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert 6 <= len(_records(killed)) < 18, "killed too early or too late to test resume"
    for root in (killed, whole):
        done = subprocess.run([sys.executable, "-m", "kvbench", *args, f"results_dir={root}"], cwd=tmp_path,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
    resumed, uninterrupted = _records(killed), _records(whole)
    assert set(resumed) == set(uninterrupted) and len(resumed) == 18
    for key, recs in resumed.items():
        assert len(recs) == 1, f"{key} recorded {len(recs)} times"
        assert recs[0]["turns"][0]["prediction"] == uninterrupted[key][0]["turns"][0]["prediction"]
        assert recs[0]["score"] == uninterrupted[key][0]["score"]


def test_a_grouped_multirun_batches_samples_of_every_point_with_sample_batch(tmp_path):
    """`engine.sample_batch=2` in a grouped sweep puts two samples of each point in one batch (it was ignored
    there: the group batched one sample's points only); the records equal one sample at a time, bit for bit."""
    args = ["-m", "model=tiny_llama", "task=twostage_retr", "task.num_samples=2", "task.max_new_tokens=4",
            "method=full,snapkv", "budget=40", "show_progress=false"]
    runs = {}
    for batch in (1, 2):
        root = tmp_path / f"batch{batch}"
        done = subprocess.run([sys.executable, "-m", "kvbench", *args, f"engine.sample_batch={batch}",
                               f"results_dir={root}"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        runs[batch] = (_records(root), done.stdout)
    (one, _), (two, said) = runs[1], runs[2]
    assert "decoding 2 points together (2 samples at a time), 2 samples to run" in said
    assert set(one) == set(two) and len(one) == 4  # the same point directories: sample_batch is no identity
    for key, (record,) in two.items():
        assert record["decode_batched_rows"] == 4 and one[key][0]["decode_batched_rows"] == 2
        assert_same_records(one[key][0], record)


BROKEN_METHOD = """
import sys
from kvbench.core.errors import KVBenchError
from kvbench.methods.exact_topk import ExactTopK

def broken(self, *args, **kwargs):
    raise {error}("a method's bug, injected by the test")

ExactTopK.select = broken  # every decode step of Exact-TopK raises
from kvbench.cli.main import main
sys.argv = ["kvbench", *sys.argv[1:]]
main()
"""


def test_a_point_that_raises_in_a_group_stops_alone_and_the_sweep_goes_on(tmp_path):
    """One point's error (a bug, not an out-of-memory, which is recorded as such) stopped the whole grouped sweep,
    losing every later point. Now its batch runs again one row at a time, the other points record every sample
    (bitwise what they record without it), and the failed point's own job runs it alone and reports the error,
    as Hydra's basic launcher does."""
    script = tmp_path / "broken_method.py"
    script.write_text(BROKEN_METHOD.format(error="RuntimeError"))
    args = ["-m", "model=tiny_llama", "task=twostage_retr", "task.num_samples=3", "task.max_new_tokens=4",
            "budget=40", "show_progress=false"]
    broken = subprocess.run([sys.executable, str(script), *args, "method=exact_topk,full,adakv",
                             f"results_dir={tmp_path / 'broken'}"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=600)
    clean = subprocess.run([sys.executable, "-m", "kvbench", *args, "method=full,adakv",
                            f"results_dir={tmp_path / 'clean'}"], cwd=tmp_path, capture_output=True, text=True,
                           timeout=600)
    assert clean.returncode == 0, clean.stderr[-2000:]
    said = broken.stdout + broken.stderr
    assert broken.returncode != 0 and "a method's bug, injected by the test" in said
    assert "failed on sample twostage_retr-4096-0" in said and "FAILED: " in said and "method=exact_topk" in said
    records, expected = _records(tmp_path / "broken"), _records(tmp_path / "clean")
    assert not any("exact_topk" in point for point, _ in records)
    assert set(records) == set(expected) and len(records) == 6  # full and Ada-KV: every sample, once
    for key, (record,) in records.items():
        assert_same_records(expected[key][0], record)


def test_a_point_stopped_by_a_kvbench_error_in_a_sweep_stops_alone(tmp_path):
    """An error kvbench names in one line (`KVBenchError`) met while a sweep's point runs exited the process at that
    job, so the sweep's later jobs never ran. Now that job fails after its one line, the others run, and the sweep
    ends with a non-zero status and the failed job named."""
    script = tmp_path / "broken_method.py"
    script.write_text(BROKEN_METHOD.format(error="KVBenchError"))
    result = subprocess.run([sys.executable, str(script), "-m", "model=tiny_llama", "task=twostage_retr",
                             "task.num_samples=2", "task.max_new_tokens=4", "budget=40", "show_progress=false",
                             "method=exact_topk,full,adakv", "hydra.launcher.max_group=1",  # each point its own job
                             f"results_dir={tmp_path}"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 1, result.stderr[-2000:]
    assert result.stderr.count("kvbench: error: a method's bug, injected by the test") == 1
    assert "FAILED: " in result.stdout and "method=exact_topk" in result.stdout.split("FAILED: ")[1]
    records = _records(tmp_path)
    assert sorted({point.split("/")[2] for point, _ in records}) == ["adakv", "full"] and len(records) == 4
