"""Stage timing of a decode step (`profiler.stages=true`, `kvbench.core.stages`): nested names, per-step sums,
the warm-up left out; nothing timed, synchronised or traced without a timer; a stage-timed profile decodes
eagerly, names the same tokens as an untimed run, and its stages add up within its steps; its points are points
of their own while every other profiled point keeps its hash; CTKVR Table 13's layout reads them. (A stage
setting without a profile is refused in tests/test_cli.py.)"""

from __future__ import annotations

import time

import matplotlib.pyplot as plt
import pandas as pd
import pytest
import torch
import torch._dynamo.testing
from omegaconf import OmegaConf

from kvbench.core import stages
from kvbench.core.stages import StageTimer, end_step, stage
from kvbench.engine.config import EngineConfig
from kvbench.engine.sample import STAGE_TIMED_REASON, run_sample
from kvbench.methods import build_method
from kvbench.profiling.profiler import PhaseProfiler, combine_repeats
from kvbench.reporting.efficiency import ctkvr_table13, efficiency_table
from kvbench.results.store import point_hash
from kvbench.run.identity import point_identity, resolved_decode_path
from kvbench.tasks.synthetic import Synthetic

CTKVR_STAGES = {"select", "select/recall", "select/rerank", "select/gather", "select/dcu", "attention",
                "attention/stored", "attention/external"}


def test_nested_stages_are_named_by_their_path_and_summed_per_step():
    timer = StageTimer(torch.device("cpu"))
    with timer.active():
        for step in range(3):
            for _layer in range(2):  # a stage entered once per layer adds up over the step
                with stage("select"):
                    with stage("recall"):
                        time.sleep(0.002 * (step + 1))
            end_step()
    assert [sorted(s) for s in timer.steps] == [["select", "select/recall"]] * 3
    for step, seconds in enumerate(timer.steps):
        assert seconds["select"] >= seconds["select/recall"] >= 2 * 0.002 * (step + 1)
    summary = timer.summary(warmup=1)  # the first step left out
    assert summary["select/recall"] == pytest.approx(1e3 * (timer.steps[1]["select/recall"]
                                                            + timer.steps[2]["select/recall"]) / 2)
    assert timer.summary(warmup=5) == timer.summary(warmup=0)  # fewer steps than the warm-up: all of them


def test_without_a_timer_a_stage_is_one_shared_null_context_and_traces_into_one_graph():
    assert stages._TIMER is None and stage("a") is stage("b")
    end_step()  # a no-op

    def step(x):
        with stage("select"):
            y = x * 2
        with stage("attention"):
            return y + 1

    counter = torch._dynamo.testing.CompileCounter()
    torch._dynamo.reset()
    assert torch.equal(torch.compile(step, backend=counter, fullgraph=True)(torch.ones(3)), torch.full((3,), 3.0))
    assert counter.frame_count == 1 and counter.op_count == 2


def test_a_timer_is_active_only_inside_its_block_and_an_interrupted_step_is_dropped():
    timer = StageTimer(torch.device("cpu"))
    with pytest.raises(RuntimeError), timer.active():
        with stage("select"):
            raise RuntimeError("a failed step")
    assert stages._TIMER is None and timer.steps == []
    with timer.active():
        with stage("attention"):
            pass
        end_step()
    assert [list(s) for s in timer.steps] == [["attention"]]


def _sample(lm, length: int = 400, new: int = 10):
    task = Synthetic(lengths=[length], max_new_tokens=new)
    task.max_positions = lm.max_positions
    return task.samples(None, seed=3)[0]


def test_a_stage_timed_ctkvr_profile_times_its_modules_and_keeps_the_tokens(tiny_llama):
    sample = _sample(tiny_llama)
    engine = EngineConfig(reuse_prefill=False, topk_recall=False)
    plain = run_sample(tiny_llama, build_method("ctkvr"), 32, sample, engine)
    runs = [run_sample(tiny_llama, build_method("ctkvr"), 32, sample, engine,
                       PhaseProfiler(tiny_llama.device, warmup_steps=2, stages=True)) for _ in range(2)]
    def outputs(record):
        return [(turn["prediction"], turn["nll"]) for turn in record["turns"]]

    assert all(outputs(run) == outputs(plain) for run in runs)  # timing changes no prediction or NLL
    record = combine_repeats(runs, warmup_steps=2)
    profile = record["profile"]
    assert set(profile["stage_ms"]) == CTKVR_STAGES
    ms = profile["stage_ms"]
    assert all(value > 0 for value in ms.values())
    assert ms["select"] >= sum(ms[f"select/{part}"] for part in ("recall", "rerank", "gather", "dcu"))
    assert ms["attention"] >= ms["attention/stored"] + ms["attention/external"]
    each = [run["profile"]["decode_step_ms"][2:] for run in runs]
    assert profile["decode_ms_mean"] == pytest.approx(sum(map(sum, each)) / sum(map(len, each)))
    assert ms["select"] + ms["attention"] < profile["decode_ms_mean"]  # the rest: projections, MLP, norms
    for key in CTKVR_STAGES:  # the repeats' mean
        assert ms[key] == pytest.approx(sum(run["profile"]["stage_ms"][key] for run in runs) / 2)

    untimed = run_sample(tiny_llama, build_method("ctkvr"), 32, sample, engine,
                         PhaseProfiler(tiny_llama.device, warmup_steps=2))
    assert "stage_ms" not in untimed["profile"] and "decode_ms_mean" not in untimed["profile"]


def test_a_stage_timed_profile_decodes_eagerly_where_compiling_was_asked(tiny_llama):
    sample = _sample(tiny_llama, 200, 6)
    record = run_sample(tiny_llama, build_method("snapkv"), 32, sample, EngineConfig(compile=True),
                        PhaseProfiler(tiny_llama.device, warmup_steps=1, stages=True))
    assert record["decode_path"] == "eager" and record["decode_path_reason"] == STAGE_TIMED_REASON
    assert set(record["profile"]["stage_ms"]) == {"attention"}  # an eviction method selects nothing per step


def _profiled_cfg(stages_setting: bool | None, compile_setting="auto"):
    profiler = {"warmup_steps": 2, "repeats": 1}
    if stages_setting is not None:
        profiler["stages"] = stages_setting
    return OmegaConf.create({
        "model": {"name": "tiny_llama", "dtype": "float32", "device": "cpu"},
        "task": {"name": "synthetic", "seq_len": 640}, "method": {"name": "snapkv", "window": 32}, "budget": 64,
        "compress_question": True, "engine": {"nll": True, "compile": compile_setting}, "seed": 0,
        "profile": True, "profiler": profiler})


def test_stage_timed_points_are_their_own_and_every_other_profiled_point_keeps_its_hash():
    before = point_hash(point_identity(_profiled_cfg(None)))  # a profiled point from before the setting
    assert point_hash(point_identity(_profiled_cfg(False))) == before
    timed = _profiled_cfg(True, compile_setting=True)
    assert point_hash(point_identity(timed)) != before
    assert resolved_decode_path(timed) == "eager" and resolved_decode_path(_profiled_cfg(False, True)) == "compiled"


def test_table13_splits_each_step_into_ctkvrs_modules_and_the_rest():
    records = []
    for method, stage_ms in (("full", {"attention": 1.0}),
                             ("ctkvr", {"select": 3.0, "select/recall": 1.0, "select/rerank": 0.8,
                                        "select/gather": 0.3, "select/dcu": 0.2, "attention": 2.0,
                                        "attention/stored": 0.9, "attention/external": 1.0})):
        for sample, scale in (("a", 1.0), ("b", 3.0)):  # two samples: their means
            records.append({"method": method, "budget": 64 if method == "ctkvr" else None, "seq_len": 4096,
                            "sample_id": sample, "profile.decode_ms_median": 9.0 * scale,
                            "profile.decode_ms_mean": 10.0 * scale,
                            **{f"profile.stage_ms.{k}": v * scale for k, v in stage_ms.items()}})
    table = efficiency_table(pd.DataFrame(records))
    fig, axes = plt.subplots(1, 2)
    rows = ctkvr_table13(table, axes).set_index("method")
    plt.close(fig)
    ctkvr, full = rows.loc["ctkvr"], rows.loc["full"]
    assert ctkvr["step_ms_mean"] == pytest.approx(20.0)
    assert ctkvr["Q2Q(c) recall ms"] == pytest.approx(2.0) and ctkvr["Q2K rerank ms"] == pytest.approx(1.6)
    assert ctkvr["host attention ms"] == pytest.approx(2 * (0.3 + 1.0))
    assert ctkvr["resident attention ms"] == pytest.approx(2 * (2.0 - 1.0))  # the stored rows and the merge
    assert ctkvr["DCU ms"] == pytest.approx(0.4) and ctkvr["other selection ms"] == pytest.approx(2 * 0.7)
    parts = [c for c in rows.columns if c.endswith(" ms")]
    assert ctkvr[parts].sum() == pytest.approx(ctkvr["step_ms_mean"])  # the parts add up to the step
    assert full["resident attention ms"] == pytest.approx(2.0) and full[parts].sum() == pytest.approx(20.0)
    with pytest.raises(ValueError, match="profiler.stages=true"):
        ctkvr_table13(efficiency_table(pd.DataFrame([{k: v for k, v in r.items() if "stage_ms" not in k}
                                                     for r in records])), axes)
