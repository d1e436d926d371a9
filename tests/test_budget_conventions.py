"""Each paper preset counts the budget as its paper does, read from the records a run writes (tiny random
Llamas, the preset's own method configs): RocketKV's t includes the estimate's traffic, CTKVR's baselines
attend the budget, OmniKV's budget is the share of the prompt's KV kept (Mem%), dense layers included."""

from __future__ import annotations

import math

import pytest
from conftest import model_cfg
from test_presets import composed

from kvbench.engine.config import EngineConfig
from kvbench.engine.sample import run_sample
from kvbench.methods import build_method, method_parameters
from kvbench.models import load_model
from kvbench.tasks.base import Sample, Turn

PROMPT = 400
NEW = 8
ENGINE = EngineConfig(nll=False, reuse_prefill=False, topk_recall=False)


def record(lm, preset: str, method: str, budget: float) -> dict:
    """The record of one sample of `preset`'s point (method, budget) on `lm` (a random-token prompt)."""
    cfg = composed(preset, (f"method={method}",))
    built = build_method(cfg.method.name, **method_parameters(cfg.method))
    sample = Sample(id="s", task="synthetic", context="", chat_template=False,
                    turns=[Turn(question="", answers=[], max_new_tokens=NEW, metric="none")],
                    token_prompt={"kind": "random", "length": PROMPT, "seed": 3}, meta={"min_new_tokens": NEW})
    return run_sample(lm, built, budget, sample, ENGINE)


def generated(lm, preset: str) -> float:
    """Tokens generated before a decode step, averaged over the steps: what every layer attends beyond the
    prompt (full attention's record attends PROMPT plus that)."""
    return record(lm, preset, "full", 64)["decode_attended_tokens_per_head"] - PROMPT


@pytest.fixture(scope="module")
def smollm2_deep_llama():
    """A random Llama as deep as SmolLM2 (30 layers): OmniKV's dense share f depends on the depth."""
    return load_model(model_cfg("tiny_llama", **{"config.num_hidden_layers": 30}))


@pytest.mark.parametrize("preset", ["rocketkv_fig5_cpu", "rocketkv_fig5"])
@pytest.mark.parametrize("budget", [64, 128])
def test_rocketkv_presets_count_the_estimate_in_the_budget(tiny_llama, preset, budget):
    """RocketKV §4: every sparse method reads t tokens' worth per KV group and step, attending t/2."""
    for method in ("quest", "hsa", "rocketkv"):
        rec = record(tiny_llama, preset, method, budget)
        assert rec["decode_attended_tokens_per_head"] == budget // 2, method
        assert rec["decode_read_tokens_per_group"] == pytest.approx(budget, rel=0.15), method


@pytest.mark.parametrize("preset", ["ctkvr_table2_cpu", "ctkvr_table2"])
def test_ctkvr_presets_attend_the_budget(tiny_llama_deep, preset):
    """CTKVR §4.1.2: the baselines attend a sparsity budget of rho' tokens (Quest with page 16 and its first two
    layers dense; SnapKV keeping rho'), CTKVR attends rho' retrieved rows plus its resident tokens."""
    budget, layers = 64, tiny_llama_deep.model.config.num_hidden_layers
    tail = generated(tiny_llama_deep, preset)
    full = PROMPT + tail
    quest = record(tiny_llama_deep, preset, "quest_ctkvr", budget)
    assert quest["decode_attended_tokens_per_head"] == pytest.approx((2 * full + (layers - 2) * budget) / layers)
    bounds = (layers - 2) / layers * math.ceil(PROMPT / 16)  # one page bound per 16 tokens, on top
    assert quest["decode_read_tokens_per_group"] - quest["decode_attended_tokens_per_head"] == pytest.approx(bounds, abs=1)
    assert record(tiny_llama_deep, preset, "snapkv", budget)["decode_attended_tokens_per_head"] == budget + tail
    ctkvr = record(tiny_llama_deep, preset, "ctkvr", budget)
    plan = ctkvr["budget_plan"]
    resident = plan["n_init"] + plan["n_local"]
    assert ctkvr["decode_attended_tokens_per_head"] == pytest.approx(budget + resident + tail)


@pytest.mark.parametrize("preset", ["omnikv_fig3_cpu", "omnikv_fig3"])
@pytest.mark.parametrize("memory", [0.3, 0.4, 0.5])
def test_omnikv_presets_give_omnikv_and_h2o_the_same_memory_share(smollm2_deep_llama, preset, memory):
    """OmniKV §4.1: Mem% = f + (k / N)(1 - f); H2O keeps Mem% of the prompt. Measured as the prompt tokens the
    layers attend at a decode step over the prompt's whole KV."""
    lm = smollm2_deep_llama
    tail = generated(lm, preset)
    omnikv = record(lm, preset, "omnikv_mem", memory)
    dense = omnikv["budget_plan"]["dense_share"]
    assert dense == pytest.approx(8 / 30)  # filter layers {2, 8, 18}, one wait layer each, layers 0-1
    k = omnikv["budget_plan"]["k"]
    assert k == round(PROMPT * (memory - dense) / (1 - dense))
    measured = (omnikv["decode_attended_tokens_per_head"] - tail) / PROMPT
    assert measured == pytest.approx(memory, abs=1 / PROMPT)
    h2o = record(lm, preset, "h2o_recent", memory)
    assert (h2o["decode_attended_tokens_per_head"] - tail) / PROMPT == pytest.approx(memory, abs=1 / PROMPT)
