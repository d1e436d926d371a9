"""Seeded sampled decoding (kvbench.engine.decoding): transformers' warper order and top-p set on hand-made logits,
per-sample seeded draws that no batch or group changes, greedy decoding untouched, what records and point
identities say."""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf

from kvbench.core.errors import KVBenchError
from kvbench.engine.config import EngineConfig, check_sampling, point_samples
from kvbench.engine.decoding import TokenChooser, decoding_for, warp
from kvbench.engine.sample import run_group, run_sample
from kvbench.methods import build_method
from kvbench.tasks.base import Sample, Turn


def reference_warp(logits: list[float], temperature: float, top_p: float) -> set[int]:
    """The tokens nucleus sampling may draw, computed independently: scale by 1/T, then walk the tokens from the
    most probable down and keep each one while the mass of the tokens above it is still below top_p (the first is
    always kept)."""
    scaled = [x / temperature for x in logits]
    top = max(scaled)
    weights = [math.exp(x - top) for x in scaled]
    total = sum(weights)
    probs = [w / total for w in weights]
    kept, above = set(), 0.0
    for i in sorted(range(len(probs)), key=lambda i: -probs[i]):
        if kept and above >= top_p:
            break
        kept.add(i)
        above += probs[i]
    return kept


def kept_set(scores: torch.Tensor) -> set[int]:
    return {int(i) for i in torch.nonzero(torch.isfinite(scores)).flatten()}


HAND_MADE = [
    [2.0, 1.0, 0.0, -1.0, -3.0],
    [0.3, 2.5, -0.7, 2.4, 1.1, -2.0, 0.0],
    [5.0, 4.9, 4.8, -10.0],
]


@pytest.mark.parametrize("logits", HAND_MADE)
@pytest.mark.parametrize("temperature,top_p", [(1.0, 0.9), (0.6, 0.95), (0.5, 0.5), (2.0, 0.8), (0.6, 1.0)])
def test_warpers_keep_the_reference_nucleus_and_scale_by_temperature(logits, temperature, top_p):
    scores = warp(torch.tensor(logits), temperature, top_p)
    assert kept_set(scores) == reference_warp(logits, temperature, top_p)
    kept = sorted(kept_set(scores))
    torch.testing.assert_close(scores[kept], torch.tensor(logits)[kept] / temperature)


def test_warpers_match_transformers_own_in_generate_order():
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

    generator = torch.Generator().manual_seed(3)
    for _ in range(20):
        logits = torch.randn(1, 50, generator=generator) * 3
        theirs = TopPLogitsWarper(0.9, min_tokens_to_keep=1)(None, TemperatureLogitsWarper(0.6)(None, logits))
        assert torch.equal(warp(logits[0], 0.6, 0.9), theirs[0])


def test_temperature_comes_before_top_p():
    """Order matters: at T = 0.5 the top token holds 0.865 of the mass, so top-p 0.8 keeps it alone; top-p on the
    unscaled logits (0.665) would keep two."""
    logits = [2.0, 1.0, 0.0, -1.0]
    assert kept_set(warp(torch.tensor(logits), 0.5, 0.8)) == {0} == reference_warp(logits, 0.5, 0.8)
    assert reference_warp(logits, 1.0, 0.8) == {0, 1}


def test_top_p_always_keeps_the_most_probable_token():
    scores = warp(torch.tensor([0.1, 3.0, 0.2]), 1.0, 1e-6)
    assert kept_set(scores) == {1}
    chooser = TokenChooser(decoding_for(sampled_sample(seed=5, top_p=1e-6), "auto", 0))
    assert {chooser(torch.tensor([0.1, 3.0, 0.2])) for _ in range(20)} == {1}


def test_top_k_comes_between_temperature_and_top_p():
    from transformers.generation.logits_process import TopKLogitsWarper

    logits = torch.tensor([1.0, 4.0, 3.0, 2.0, 0.5])
    scores = warp(logits, 0.7, 1.0, top_k=2)
    assert kept_set(scores) == {1, 2}
    assert torch.equal(scores, TopKLogitsWarper(2)(None, (logits / 0.7)[None])[0])


def test_draws_follow_the_warped_distribution():
    """Many draws of one seeded chooser land only on the nucleus, in proportion to its renormalised mass."""
    logits = torch.tensor([2.0, 1.5, 0.5, -1.0, -4.0])
    chooser = TokenChooser(decoding_for(sampled_sample(seed=11, temperature=1.0, top_p=0.8), "auto", 0))
    counts = torch.bincount(torch.tensor([chooser(logits) for _ in range(4000)]), minlength=5)
    nucleus = sorted(reference_warp(logits.tolist(), 1.0, 0.8))
    expected = torch.softmax(logits[nucleus], dim=0)
    assert counts[[i for i in range(5) if i not in nucleus]].sum() == 0
    assert torch.allclose(counts[nucleus] / 4000.0, expected, atol=0.03)


def sampled_sample(seed: int | None = 1234, temperature: float = 1.0, top_p: float = 0.95, sample_id: str = "s-0",
                   context: str = "Count the apples: one apple, two apples, three apples, four apples.") -> Sample:
    meta = {"sampling": {"temperature": temperature, "top_p": top_p, **({} if seed is None else {"seed": seed})}}
    return Sample(id=sample_id, task="sampled", context=context,
                  turns=[Turn("How many apples?", ["four"], max_new_tokens=12, metric="string_match_all")], meta=meta)


def greedy_twin(sample: Sample) -> Sample:
    return Sample(id=sample.id, task=sample.task, context=sample.context, turns=sample.turns, meta={})


def tokens_of(record: dict) -> str:
    return record["turns"][0]["prediction"]


def decoded(record: dict) -> list[tuple]:
    """What a record says was decoded (timings left out)."""
    return [(t["prediction"], t["new_tokens"], t["stop_reason"], t["score"], t["nll"]) for t in record["turns"]]


def test_a_seed_gives_the_same_tokens_and_another_seed_others(tiny_llama):
    method = build_method("snapkv", window=8)
    first = run_sample(tiny_llama, method, 32, sampled_sample(seed=7), EngineConfig(nll=False))
    again = run_sample(tiny_llama, method, 32, sampled_sample(seed=7), EngineConfig(nll=False))
    assert decoded(first) == decoded(again)
    assert first["decoding"] == {"kind": "sampled", "temperature": 1.0, "top_p": 0.95, "top_k": None, "seed": 7}
    others = {tokens_of(run_sample(tiny_llama, method, 32, sampled_sample(seed=s), EngineConfig(nll=False)))
              for s in (8, 9, 10)}
    assert len(others | {tokens_of(first)}) > 1  # a random tiny model at T = 1: seeds draw different tokens
    greedy = tokens_of(run_sample(tiny_llama, method, 32, greedy_twin(sampled_sample()), EngineConfig(nll=False)))
    assert others | {tokens_of(first)} != {greedy}


def test_a_sample_without_a_seed_draws_from_the_runs_seed_and_its_id(tiny_llama):
    method = build_method("full")
    a = run_sample(tiny_llama, method, 64, sampled_sample(seed=None), EngineConfig(seed=1, nll=False))
    b = run_sample(tiny_llama, method, 64, sampled_sample(seed=None), EngineConfig(seed=1, nll=False))
    assert decoded(a) == decoded(b) and a["decoding"]["seed"] == b["decoding"]["seed"]
    assert decoding_for(sampled_sample(seed=None), "auto", 2).seed != a["decoding"]["seed"]
    assert decoding_for(sampled_sample(seed=None, sample_id="s-1"), "auto", 1).seed != a["decoding"]["seed"]


def test_draws_do_not_depend_on_the_group_or_the_samples_beside_them(tiny_llama):
    """A grouped sweep (several points of a sample together) and engine.sample_batch (several samples of a point
    together) decode each row with its own generator: every row draws what it draws alone, in any order."""
    snapkv, full = build_method("snapkv", window=8), build_method("full")
    s0, s1 = sampled_sample(seed=21, sample_id="s-0"), sampled_sample(seed=22, sample_id="s-1", context="Pears: "
                                                                                                    "five of them.")
    cfg = EngineConfig()
    alone = {(m.name, s.id): run_sample(tiny_llama, m, 32, s, cfg) for m in (snapkv, full) for s in (s0, s1)}
    grouped = run_group(tiny_llama, [(full, 32, s0), (snapkv, 32, s0)], cfg)
    batch = run_group(tiny_llama, [(snapkv, 32, s1), (snapkv, 32, s0)], cfg)
    for record, key in zip(grouped + batch, [("full", "s-0"), ("snapkv", "s-0"), ("snapkv", "s-1"),
                                             ("snapkv", "s-0")]):
        assert decoded(record) == decoded(alone[key]), key
        assert record["decoding"] == alone[key]["decoding"]
    # the points of one sample share its seed (common random numbers across methods)
    assert alone[("full", "s-0")]["decoding"]["seed"] == alone[("snapkv", "s-0")]["decoding"]["seed"]


def test_sampled_rows_batch_and_draw_what_they_draw_alone(tiny_llama):
    """Sampled rows share decode forwards by default (each with its own generator, its logits the same bits in
    any batch), one row at a time with `engine.batch_rows=1`: the same draws either way."""
    method = build_method("full")
    rows = [(method, 64, sampled_sample()), (method, 64, greedy_twin(sampled_sample())),
            (method, 64, sampled_sample(seed=5, sample_id="s-5"))]
    batched = run_group(tiny_llama, rows, EngineConfig())
    single = run_group(tiny_llama, rows, EngineConfig(batch_rows=1))
    assert [r["decode_batched_rows"] for r in batched] == [3, 3, 3]
    assert [r["decode_batched_rows"] for r in single] == [1, 1, 1]
    assert [decoded(r) for r in batched] == [decoded(r) for r in single]
    assert [t["nll"] for r in batched for t in r["turns"]] == [t["nll"] for r in single for t in r["turns"]]


def test_greedy_decoding_is_unchanged_and_says_what_it_set_aside(tiny_llama):
    method = build_method("snapkv", window=8)
    plain = run_sample(tiny_llama, method, 32, greedy_twin(sampled_sample()), EngineConfig())
    forced = run_sample(tiny_llama, method, 32, sampled_sample(), EngineConfig(sampling="greedy"))
    assert plain["decoding"] == {"kind": "greedy"}
    assert decoded(forced) == decoded(plain)
    assert forced["decoding"] == {"kind": "greedy", "by": "engine.sampling=greedy",
                                  "ignored": {"temperature": 1.0, "top_p": 0.95, "seed": 1234}}
    zero = sampled_sample(temperature=0.0)  # temperature 0: the protocol is greedy
    assert decoded(run_sample(tiny_llama, method, 32, zero, EngineConfig())) == decoded(plain)


def test_bad_protocol_values_are_one_error_line():
    with pytest.raises(KVBenchError, match="top_p in \\(0, 1\\]"):
        decoding_for(sampled_sample(top_p=1.5), "auto", 0)
    with pytest.raises(KVBenchError, match="engine.sampling='nucleus'"):
        decoding_for(sampled_sample(), "nucleus", 0)


def test_config_checks_and_point_identity():
    from kvbench.run.identity import written_point_identity

    base = OmegaConf.load("kvbench/conf/config.yaml")
    math500 = OmegaConf.load("kvbench/conf/task/math500.yaml")
    assert point_samples(base.engine, math500) and not point_samples(base.engine, {"name": "niah"})
    assert not point_samples(OmegaConf.merge(base.engine, {"sampling": "greedy"}), math500)
    assert point_samples(base.engine, {"name": "suite", "sum_temperature": 0.8})  # a subset's protocol samples
    assert not point_samples(base.engine, {"name": "math500", "temperature": None})
    with pytest.raises(KVBenchError, match="engine.sampling must be auto"):
        check_sampling(OmegaConf.merge(base.engine, {"sampling": "top_p"}), math500)
    check_sampling(OmegaConf.merge(base.engine, {"batch_rows": 16}), math500)  # sampled points batch too

    def identity(task, **engine):
        cfg = OmegaConf.create({"model": {"name": "m"}, "task": task, "method": {"name": "full"}, "budget": 64,
                                "compress_question": True, "engine": {**base.engine, **engine}, "seed": 0})
        return written_point_identity(cfg)

    niah = {"name": "niah", "seq_len": 4096}
    # greedy points hash as before the setting existed, whatever it says
    assert identity(niah) == identity(niah, sampling="greedy")
    assert not {"sampling", "decoding"} & set(identity(niah)["engine"])
    assert identity(math500)["engine"]["decoding"] == "sampled"
    assert "decoding" not in identity(math500, sampling="greedy")["engine"]


@pytest.mark.integration
def test_keydiff_math500_cpu_slice_samples_each_response_with_its_own_seed(tmp_path):
    """The CPU twin end to end (sweep, then report): 2 sampled responses of one problem, Full and KeyDiff; each
    response has its own seed, both methods draw response k from the same one, and the report is KeyDiff's
    Table 3 layout over the 2 responses (their mean is the point's score: pass@1)."""
    import json

    import pandas as pd
    from preset_slice import run_preset_slice

    report = run_preset_slice("keydiff_math500_cpu", tmp_path, "task.num_samples=1", "task.samples_per_problem=2",
                              "task.max_new_tokens=24", "method=full,keydiff_window", "budget=32",
                              "engine.nll=false")
    records = {}
    for path in (tmp_path / "results").rglob("records.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            records[(record["point"]["method"], record["sample_id"])] = record
    assert len(records) == 4
    decodings = {key: r["decoding"] for key, r in records.items()}
    assert all(d["kind"] == "sampled" and (d["temperature"], d["top_p"]) == (0.6, 0.95) for d in decodings.values())
    first, second = "math500/arith/1.json/0", "math500/arith/1.json/1"
    assert decodings[("full", first)]["seed"] != decodings[("full", second)]["seed"]
    for sample in (first, second):
        assert decodings[("full", sample)]["seed"] == decodings[("keydiff", sample)]["seed"]
    table = pd.read_csv(report / "table.csv")
    assert {"flex_match", "exact_match", "avg_gen_length"} <= set(table.columns)
    assert sorted(table["n"]) == [2, 2]
    for method, row in table.set_index("method").iterrows():
        name = "keydiff" if method.startswith("keydiff") else method
        scores = [records[(name, s)]["score"] for s in (first, second)]
        assert row["flex_match"] == pytest.approx(sum(scores) / len(scores))  # records score in [0, 1]
