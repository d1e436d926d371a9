"""The eviction family on the grown interface: H2O, TOVA, PyramidKV, Ada-Pyramid, KeyDiff, KeyL2Norm, per-query-head
SnapKV; block-wise prefill and decode-time eviction for every scored method. Tiny random Llama and Qwen3."""

from __future__ import annotations

import math
import random
import re
from typing import Literal

import pytest
import torch
from conftest import random_ids
from reference import kept_masks, reference_chunks

from kvbench.core.errors import KVBenchError
from kvbench.engine.config import EngineConfig
from kvbench.engine.sample import run_sample
from kvbench.engine.session import Session
from kvbench.engine.snapshots import PrefillSnapshots
from kvbench.methods import build_method
from kvbench.methods.base import keep_top
from kvbench.methods.keydiff import keydiff_scores
from kvbench.methods.pyramidkv import pyramid_budgets
from kvbench.methods.tova import last_query_attention
from kvbench.run.caches import prefill_snapshots
from kvbench.tasks.base import Sample, Turn

PROMPT = 300
SMALL = {"window": 8}  # SnapKV-family windows that fit a 48-token budget
# every scored method, as (name, parameters): defaults plus the options that change what is kept
SCORED = [
    ("streamingllm", {}),
    ("snapkv", SMALL),
    ("snapkv", {**SMALL, "pooling": "avg"}),
    ("snapkv", {**SMALL, "granularity": "head"}),
    ("adakv", SMALL),
    ("pyramidkv", SMALL),
    ("ada_pyramid", SMALL),
    ("h2o", {}),
    ("h2o", {"recent_ratio": 0.5}),
    ("tova", {}),
    ("tova", {"head_agg": "layer"}),
    ("keydiff", {}),
    ("keydiff", {"anchor": "mean_normalized"}),
    ("keydiff", {"anchor": "median", "window_ratio": 0.2}),
    ("keydiff", {"metric": "euclidean"}),
    ("keyl2norm", {}),
    ("random", {}),
]
IDS = [f"{name}-{'-'.join(f'{k}={v}' for k, v in params.items())}" for name, params in SCORED]
ONE_SHOT = {"block_size": None, "decode_every": 0}
BLOCKWISE = {"block_size": 32, "decode_every": 1}


def record_chunks(session: Session) -> tuple[list[list[int]], list, list[torch.Tensor]]:
    """Spy on a session's forward passes: each chunk, what the cache held of the past before it, its logits."""
    chunks, past, outs = [], [], []
    forward = session.forward

    def spy(ids, logits_to_keep=1, evict=False):
        past.append(kept_masks(session.cache, session.position) if session.position else None)
        chunks.append(list(ids))
        out = forward(ids, logits_to_keep, evict)
        outs.append(out[-1])
        return out

    session.forward = spy
    return chunks, past, outs


def run_and_record(lm, method, budget: int, ids: list[int], steps: int):
    """The engine's own path (block loop, decode-step eviction), with every chunk recorded."""
    session = Session(lm, method, budget)
    chunks, past, outs = record_chunks(session)
    logits, _ = session.prefill(ids, compress=True)
    for _ in range(steps):
        logits = session.step(int(logits.argmax()))
    return session, chunks, past, outs


@pytest.mark.parametrize("name,params", SCORED, ids=IDS)
@pytest.mark.parametrize("schedule", [ONE_SHOT, BLOCKWISE, {"block_size": None, "decode_every": 1}],
                         ids=["one-shot", "block-wise", "decode-eviction"])
def test_logits_equal_dense_reference_on_what_each_head_held(tiny, name, params, schedule):
    """Every chunk's logits equal a dense eager run in which each head sees exactly the past tokens our cache
    held when that chunk was attended (at their original positions): eviction at the end of the segment,
    after every prefill block and at every decode step is real eviction of exactly those tokens."""
    ids = random_ids(PROMPT, seed=21)
    session, chunks, past, outs = run_and_record(tiny, build_method(name, **params, **schedule), 48, ids, steps=6)
    assert session.cache.evictions() > 0
    ref = reference_chunks(tiny.model, chunks, past)
    for ours, theirs in zip(outs, ref):
        torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("name,params", SCORED, ids=IDS)
def test_budget_at_or_above_context_is_bitwise_full_one_shot_and_block_wise(tiny, name, params):
    ids = random_ids(PROMPT, seed=22)
    budget, steps = PROMPT + 8, 6

    def run(method, block):
        session = Session(tiny, method, budget)
        chunks = [ids[i:i + block] for i in range(0, PROMPT, block)]
        logits = [session.forward(chunk, evict=method.name != "full")[-1] for chunk in chunks][-1]
        outs = [logits]
        for _ in range(steps):
            outs.append(session.step(int(outs[-1].argmax())))
        return session, outs

    for schedule in (ONE_SHOT, BLOCKWISE):
        block = schedule["block_size"] or PROMPT
        session, outs = run(build_method(name, **params, **schedule), block)
        _, full = run(build_method("full"), block)
        assert session.cache.evictions() == 0
        assert all(torch.equal(a, b) for a, b in zip(outs, full))
        assert all(n == PROMPT + steps for layer in session.cache.kept_per_head() for n in layer)
    # block-wise prefill without eviction is the one-shot prefill up to summation order (KeyDiff M1)
    _, one_shot = run(build_method("full"), PROMPT)
    for a, b in zip(outs, one_shot):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("name,params", SCORED, ids=IDS)
def test_block_wise_evicts_to_the_budget_after_every_block_and_step(tiny_llama, name, params):
    """KeyDiff's M3: after every eviction each layer holds exactly its budget (per KV group), and no head
    ever held more than its budget + the block (Ada-KV's heads differ; their layer total is what is bounded)."""
    budget, block = 48, 32
    session = Session(tiny_llama, build_method(name, **params, block_size=block), budget)
    held = []
    forward = session.forward

    def spy(ids, logits_to_keep=1, evict=False):
        out = forward(ids, logits_to_keep, evict)
        held.append([(layer.budget, sum(layer.lengths()), layer.model_kv_heads) for layer in session.cache.layers])
        return out

    session.forward = spy
    logits, _ = session.prefill(random_ids(PROMPT, seed=23), compress=True)
    for _ in range(5):
        logits = session.step(int(logits.argmax()))
    for per_layer in held[2:]:  # from the second block on, every layer is over its budget before evicting
        for layer_budget, total, kv_heads in per_layer:
            assert total == layer_budget * kv_heads
    cache = session.cache
    assert cache.peak_entries_per_head() == max(layer.peak_len for layer in cache.layers)
    if name not in ("adakv", "ada_pyramid"):
        for layer in cache.layers:
            assert layer.peak_len <= max(b for b, *_ in (p[layer.layer_idx] for p in held)) + block
    if name not in ("adakv", "ada_pyramid", "pyramidkv"):
        assert cache.peak_entries_per_head() <= budget + block


def test_block_wise_peak_is_recorded_and_bounded_for_every_method(tiny_llama):
    sample = Sample(id="s0", task="synthetic", context="".join(random.Random(0).choices("abcdefgh ", k=400)),
                    turns=[Turn("Which letter?", ["a"], max_new_tokens=8, metric="string_match_all")])
    for name, params in SCORED:
        record = run_sample(tiny_llama, build_method(name, **params, block_size=64), 96, sample, EngineConfig())
        assert record["eviction_schedule"] == {"events": ["prefill_block", "decode_step"], "block_size": 64,
                                               "decode_every": 1}
        assert record["compressed"] and record["eviction_events"] > 5 and not record["prefill_reused"]
        if name in ("adakv", "ada_pyramid"):  # heads differ; the layer's total is bounded
            continue
        bound = max(record["layer_budgets"]) + 64
        assert record["kv_peak_entries_per_head"] <= bound, (name, record["kv_peak_entries_per_head"])
        full = record["kv_bytes_full_prompt"]
        assert record["kv_peak_bytes"] <= full * bound / record["prompt_tokens"]


@pytest.mark.parametrize("name,params", [m for m in SCORED if m[0] in ("keydiff", "snapkv", "h2o", "tova", "streamingllm")])
def test_decode_time_eviction_keeps_the_cache_at_the_budget_over_512_tokens(tiny_llama, name, params):
    budget = 40
    session = Session(tiny_llama, build_method(name, **params, block_size=None, decode_every=1), budget)
    logits, _ = session.prefill(random_ids(60, seed=24), compress=True)
    stored = sum(budget * layer.model_kv_heads for layer in session.cache.layers)  # per KV group
    for _ in range(512):
        logits = session.step(int(logits.argmax()))
        assert sum(sum(layer.lengths()) for layer in session.cache.layers) == stored
    assert session.cache.peak_entries_per_head() == max(60, budget + 1)
    if name in ("snapkv", "streamingllm"):  # a recency window: the newest token is always held
        assert {int(layer.positions.max()) for layer in session.cache.layers} == {60 + 512 - 1}


def test_decode_time_eviction_is_recorded(tiny_llama):
    sample = Sample(id="s0", task="synthetic", context="x" * 40,
                    turns=[Turn("y", ["z"], max_new_tokens=512, metric="string_match_all")])
    record = run_sample(tiny_llama, build_method("keydiff", block_size=None, decode_every=1), 48, sample,
                        EngineConfig(nll=False, chat_template=False))
    assert record["prompt_tokens"] < 48 < record["new_tokens"] and record["compressed"]  # generation overflows
    assert record["kept_tokens_end_max"] == 48 and record["kept_tokens_end_mean"] == 48
    assert record["eviction_events"] == record["prompt_tokens"] + record["new_tokens"] - 1 - 48


def test_pyramid_exact_schedule_decreases_with_depth_and_sums_to_the_uniform_total():
    gen = random.Random(0)
    for _ in range(2000):
        layers, b = gen.randint(1, 80), gen.randint(0, 3000)
        candidates = gen.randint(b, 4 * b + 10)
        budgets = pyramid_budgets(layers, b, candidates, beta=gen.choice([2, 20, 50]), schedule="exact")
        assert sum(budgets) == layers * b
        assert all(x >= y for x, y in zip(budgets, budgets[1:]))
        assert max(budgets) <= max(candidates, b) and min(budgets) >= 0


def test_pyramid_default_schedule_is_the_authors_floored_step():
    """PyramidKV's code: steps = (max_num - min_num) // (L - 1), b_l = max_num - l * steps."""
    gen = random.Random(1)
    for _ in range(2000):
        layers, b, beta = gen.randint(2, 80), gen.randint(1, 3000), gen.choice([2, 20, 50])
        candidates = gen.randint(b + 1, 4 * b + 10)
        min_num, max_num = b // beta, 2 * b - b // beta
        if max_num >= candidates:
            max_num, min_num = candidates, 2 * b - candidates
        steps = (max_num - min_num) // (layers - 1)
        assert pyramid_budgets(layers, b, candidates, beta) == [max_num - layer * steps for layer in range(layers)]
        assert sum(pyramid_budgets(layers, b, candidates, beta)) >= layers * b  # the floor keeps more, never less
    # budget 128 (window 32) on 30 layers: 188 down to 14, 5.2 % more than the uniform 96 per layer
    authors = pyramid_budgets(30, 96, 30000)
    assert authors[0] == 188 and authors[-1] == 14 and sum(authors) == 3030
    # 32 layers, b = 992, beta 20: 1935 down to 75 (steps 60); the exact schedule ends at 49
    assert pyramid_budgets(32, 992, 30000)[-1] == 75 and pyramid_budgets(32, 992, 30000, schedule="exact")[-1] == 49


def test_pyramid_layers_hold_their_schedule_and_ada_pyramid_heads_sum_to_it_with_the_floor(tiny_llama_deep):
    lm = tiny_llama_deep
    ids = random_ids(PROMPT, seed=25)
    budget, window, alpha = 64, 8, 0.2
    for name, schedule_name in (("pyramidkv", "authors"), ("ada_pyramid", "authors"), ("pyramidkv", "exact")):
        schedule = pyramid_budgets(lm.model.config.num_hidden_layers, budget - window, PROMPT - window,
                                   schedule=schedule_name)
        session = Session(lm, build_method(name, window=window, layer_schedule=schedule_name), budget)
        session.prefill(ids, compress=True)
        for layer, b in zip(session.cache.layers, schedule):
            lens = layer.lengths()
            assert layer.budget == b + window
            assert sum(lens) == (b + window) * layer.num_heads
            if name == "pyramidkv":
                assert set(lens) == {b + window}
            else:
                assert min(lens) >= int(alpha * b) + window
        assert sum(layer.budget for layer in session.cache.layers) == sum(schedule) + window * len(schedule)
        if schedule_name == "exact":
            assert sum(schedule) == (budget - window) * len(schedule)


def test_keydiff_normalized_mean_anchor_ranks_exactly_as_pairwise():
    gen = torch.Generator().manual_seed(0)
    jaccard_raw = []
    for trial in range(20):
        keys = torch.randn(4, 300, 32, generator=gen) + torch.randn(4, 1, 32, generator=gen)  # mean != 0
        top = {a: keydiff_scores(keys, a).topk(64, dim=-1).indices.sort(-1).values
               for a in ("pairwise", "mean_normalized", "mean_raw")}
        assert torch.equal(top["pairwise"], top["mean_normalized"])
        for h in range(4):
            a, b = set(top["pairwise"][h].tolist()), set(top["mean_raw"][h].tolist())
            jaccard_raw.append(len(a & b) / len(a | b))
    assert min(jaccard_raw) < 1  # the raw-mean anchor is a different rule (so it is reported apart)


def test_keydiff_scores_follow_the_metric_definitions():
    keys = torch.randn(2, 50, 8)
    anchor = keys.mean(1, keepdim=True)
    cos = torch.nn.functional.cosine_similarity(keys, anchor, dim=-1)
    torch.testing.assert_close(keydiff_scores(keys, "mean_raw", "cosine"), -cos)
    torch.testing.assert_close(keydiff_scores(keys, "mean_raw", "dot"), -(keys * anchor).sum(-1))
    torch.testing.assert_close(keydiff_scores(keys, "mean_raw", "euclidean"), (keys - anchor).norm(dim=-1))
    median = keys.median(1, keepdim=True).values
    torch.testing.assert_close(keydiff_scores(keys, "median"), -torch.nn.functional.cosine_similarity(keys, median, dim=-1))


def test_h2o_accumulator_equals_brute_force_sum_of_attention_rows(tiny):
    """After block-wise prefill and decode steps with eviction, every kept token's accumulator equals the sum,
    over every query that saw it, of that query's group-mean attention on it, recomputed from scratch."""
    method = build_method("h2o", block_size=32, decode_every=1)
    seen: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, float]] = []
    observe = method.observe

    def spy(layer, queries, step):
        view = layer.head_view()
        seen.append((layer.layer_idx, queries.clone(), view.keys.clone(), view.positions.clone(), layer.scaling))
        observe(layer, queries, step)

    method.observe = spy
    session, *_ = run_and_record(tiny, method, 40, random_ids(150, seed=26), steps=8)
    for layer in session.cache.layers:
        expected: dict[tuple[int, int], float] = {}
        for idx, queries, keys, positions, scaling in seen:
            if idx != layer.layer_idx:
                continue
            heads, n = keys.shape[0], queries.shape[1]
            group = queries.shape[0] // heads
            first = int(positions.max()) - n + 1
            for h in range(heads):
                for i in range(n):
                    visible = positions[h] <= first + i
                    rows = [torch.softmax((keys[h][visible] @ queries[h * group + g, i]) * scaling, 0) for g in range(group)]
                    mean = sum(rows) / group
                    for p, w in zip(positions[h][visible].tolist(), mean.tolist()):
                        expected[(h, p)] = expected.get((h, p), 0.0) + w
        state = layer.token_state["h2o"]
        for h in range(layer.num_heads):
            for p, value in zip(layer.positions[h].tolist(), state[h].tolist()):
                assert math.isclose(value, expected[(h, p)], rel_tol=1e-4, abs_tol=1e-5), (h, p)


def test_tova_evicts_the_argmin_of_the_last_querys_group_mean_attention(tiny):
    method = build_method("tova", decode_every=1)
    seen = []
    keep = method.keep

    def spy(layer, budget, step):
        view = layer.head_view()
        seen.append((view.keys.clone(), view.positions.clone(), layer.queries[:, -1].clone(), layer.scaling))
        return keep(layer, budget, step)

    method.keep = spy
    budget = 40
    session = Session(tiny, method, budget)
    logits, _ = session.prefill(random_ids(budget, seed=27), compress=True)  # fits: nothing evicted yet
    for _ in range(3):
        seen.clear()
        logits = session.step(int(logits.argmax()))  # budget + 1 entries: exactly one goes per head
        for layer, (keys, positions, q, scaling) in zip(session.cache.layers, seen):
            group = q.shape[0] // keys.shape[0]
            for h in range(keys.shape[0]):
                probs = sum(torch.softmax(keys[h] @ q[h * group + g] * scaling, 0) for g in range(group)) / group
                evicted = set(positions[h].tolist()) - set(layer.positions[h].tolist())
                assert evicted == {int(positions[h][probs.argmin()])}


def test_last_query_attention_is_the_models_attention_row(tiny):
    ids = random_ids(80, seed=28)
    session = Session(tiny, build_method("tova"), 1000)
    session.prefill(ids, compress=True)
    tiny.model.set_attn_implementation("eager")
    try:
        with torch.inference_mode():
            attentions = tiny.model(input_ids=torch.tensor([ids]), output_attentions=True, use_cache=False).attentions
    finally:
        tiny.model.set_attn_implementation("kvbench")
    session = Session(tiny, build_method("tova"), 10)
    session.query_window = 1
    session.forward(ids)
    for layer, att in zip(session.cache.layers, attentions):
        expected = att[0, :, -1].float().view(layer.num_heads, -1, len(ids)).mean(1)
        torch.testing.assert_close(last_query_attention(layer), expected, atol=1e-6, rtol=1e-5)


def test_snapkv_per_query_head_keeps_budget_over_g_per_query_head_and_stores_them(tiny):
    ids = random_ids(PROMPT, seed=29)
    budget, window = 64, 8
    group = tiny.model.config.num_attention_heads // tiny.model.config.num_key_value_heads
    shared = Session(tiny, build_method("snapkv", window=window), budget)
    shared.prefill(ids, compress=True)
    session = Session(tiny, build_method("snapkv", window=window, granularity="head"), budget)
    session.prefill(ids, compress=True)
    for layer in session.cache.layers:
        assert layer.num_heads == tiny.model.config.num_attention_heads
        assert layer.lengths() == [budget // group] * layer.num_heads
        for positions in layer.positions:
            assert set(range(PROMPT - window, PROMPT)) <= set(positions.tolist())
        # query heads of one group choose differently: that is the point of the per-head baseline
        assert not all(torch.equal(layer.positions[0], layer.positions[g]) for g in range(1, group))
    # a group stores budget tokens in both variants, as G copies here
    assert session.cache.kv_bytes() == shared.cache.kv_bytes()
    logits = session.step(5)
    assert all(layer.lengths() == [budget // group + 1] * layer.num_heads for layer in session.cache.layers)
    assert torch.isfinite(logits).all()


def test_adakv_block_wise_keeps_each_layers_total_at_the_budget(tiny):
    budget, block = 48, 32
    session = Session(tiny, build_method("adakv", window=8, block_size=block), budget)
    logits, _ = session.prefill(random_ids(PROMPT, seed=30), compress=True)
    for _ in range(4):
        logits = session.step(int(logits.argmax()))
    assert any(layer.is_ragged for layer in session.cache.layers)
    for layer in session.cache.layers:
        assert sum(layer.lengths()) == budget * layer.num_heads
        assert min(layer.lengths()) >= int(0.2 * (budget - 8)) + 8


def test_methods_that_are_not_one_dense_pass_do_not_use_the_shared_prefill(tiny_llama):
    sample = Sample(id="s0", task="synthetic", context="".join(random.Random(1).choices("abcdefgh ", k=300)),
                    turns=[Turn("Which letter?", ["a"], max_new_tokens=6, metric="string_match_all")])
    cfg = EngineConfig(reuse_prefill=True)
    inline = EngineConfig(reuse_prefill=False)
    for name, params, shared in [("keydiff", {}, False), ("h2o", {}, False), ("tova", {"block_size": 32}, False),
                                 ("keydiff", {"block_size": None}, True), ("tova", {"decode_every": 1}, True)]:
        store = PrefillSnapshots(cfg.snapshot_cache_mb)
        run_sample(tiny_llama, build_method("full"), 64, sample, cfg, snapshots=store)  # a snapshot of this prompt
        record = run_sample(tiny_llama, build_method(name, **params), 64, sample, cfg, snapshots=store)
        assert record["prefill_reused"] is shared, name
        alone = run_sample(tiny_llama, build_method(name, **params), 64, sample, inline)
        assert record["turns"][0]["prediction"] == alone["turns"][0]["prediction"]
        assert record["nll"] == alone["nll"] and record["layer_budgets"] == alone["layer_budgets"]


def test_the_run_layer_keeps_one_prefill_store_per_process_and_size_limit():
    """What the points of a local multirun share (the engine keeps no store of its own)."""
    assert prefill_snapshots(64) is prefill_snapshots(64)
    assert prefill_snapshots(32) is not prefill_snapshots(64)


def test_a_run_sample_without_a_store_reuses_no_prefill(tiny_llama):
    sample = Sample(id="s0", task="synthetic", context="".join(random.Random(2).choices("abcdefgh ", k=300)),
                    turns=[Turn("Which letter?", ["a"], max_new_tokens=4, metric="string_match_all")])
    first = run_sample(tiny_llama, build_method("snapkv"), 64, sample, EngineConfig())
    again = run_sample(tiny_llama, build_method("snapkv"), 64, sample, EngineConfig())
    assert not first["prefill_reused"] and not again["prefill_reused"]
    assert first["turns"][0]["prediction"] == again["turns"][0]["prediction"] and first["nll"] == again["nll"]


@pytest.mark.parametrize(
    "name,params,message",
    [
        ("keydiff", {"block_size": 0}, "block_size must be a positive number of tokens"),
        ("snapkv", {"decode_every": -1}, "decode_every must be a number of decode steps"),
        ("snapkv", {"window": 0}, "window must be a positive number"),
        ("snapkv", {"kernel": 6}, "kernel must be a positive odd"),
        ("snapkv", {"granularity": "layer"}, "granularity must be group or head"),
        ("adakv", {"alpha": 2}, "alpha (the per-head floor"),
        ("adakv", {"granularity": "head"}, "adakv allocates per KV head"),
        ("pyramidkv", {"beta": 0}, "beta (the shallowest/deepest budget ratio)"),
        ("h2o", {"recent_ratio": 1.5}, "recent_ratio must be in [0, 1]"),
        ("tova", {"head_agg": "max"}, "head_agg must be group or layer"),
        ("keydiff", {"anchor": "mode"}, "anchor must be one of"),
        ("keydiff", {"anchor": "pairwise", "metric": "dot"}, "pairwise anchor (Eq. 7) is defined for the cosine"),
        ("streamingllm", {"n_sink": -1}, "n_sink must be a number of tokens >= 0"),
    ],
)
def test_method_parameters_out_of_range_are_one_clear_error(name, params, message):
    with pytest.raises(KVBenchError, match=re.escape(f"method {name}: ") + ".*" + re.escape(message)):
        build_method(name, **params)


def test_every_method_parameter_refuses_a_value_of_the_wrong_kind():
    """Each parameter of each method, given something it cannot mean, is one clear error naming it: a value of
    another kind than its annotation says (checked for every method by `Method.__post_init__`), and for a
    count or a fraction a negative number (each method's own range check). A failure lists every method, field
    and value accepted."""
    import dataclasses

    from kvbench.methods import METHODS

    wrong_by_type = {"int": ["nonsense", 2.5, True, -1], "float": ["nonsense", True, -0.5], "str": [12345, "nonsense"],
                     "bool": ["maybe", 12345]}
    checked, accepted = 0, []
    for name, cls in sorted(METHODS.items()):
        for field in dataclasses.fields(cls):
            kind = next(k for k in ("bool", "int", "float", "str") if k in str(field.type))
            for wrong in wrong_by_type[kind]:
                checked += 1
                try:
                    build_method(name, **{field.name: wrong})
                except KVBenchError as exc:
                    if not str(exc).startswith(f"method {name}: ") or field.name not in str(exc):
                        accepted.append(f"method {name}: {field.name}={wrong!r} refused without naming it: {exc}")
                else:
                    accepted.append(f"method {name}: {field.name}={wrong!r} accepted")
    assert not accepted, "\n".join(accepted)
    assert checked > 100


def test_a_new_methods_fields_are_checked_by_kind_without_a_check_of_its_own():
    """What a contributor's method gets for free: its annotations say what each field holds."""
    import dataclasses

    from kvbench.methods.base import EvictionMethod

    @dataclasses.dataclass
    class Fresh(EvictionMethod):
        name = "fresh_example"
        count: int = 4
        share: float = 0.5
        mode: Literal["first", "last"] = "first"
        shuffled: bool = False
        limit: int | None = None

    Fresh(count=0, share=1, mode="last", shuffled=True, limit=3)  # an int is a number too
    for field, wrong, kind in [("count", 2.5, "an integer"), ("count", True, "an integer"), ("share", "half", "a number"),
                               ("mode", "middle", "one of first, last"), ("shuffled", 1, "true or false"),
                               ("limit", "many", "an integer or null"), ("block_size", 1.5, "an integer or null")]:
        with pytest.raises(ValueError, match=re.escape(f"{field} must be {kind}, got {wrong!r}")):
            Fresh(**{field: wrong})


def test_a_scored_method_on_a_ragged_layer_ranks_each_heads_own_tokens_never_its_padding(tiny_llama):
    """keep_top's columns are tokens on a uniform layer; Ada-KV's heads hold different numbers of tokens (as any
    per-head eviction's do after a rollback), and the padded view's extra columns are no tokens."""
    session = Session(tiny_llama, build_method("adakv", window=8), 40)
    session.prefill(random_ids(90, seed=24), compress=True)
    layer = session.cache.layers[0]
    lengths = layer.lengths()
    assert layer.is_ragged and min(lengths) < 40 < max(lengths)
    method = build_method("keyl2norm")
    kept = method.keep(layer, 40, session.step_context())
    scores = method.score(layer, session.step_context())
    for head, (idx, n) in enumerate(zip(kept, lengths)):
        assert len(idx) == min(40, n) and int(idx.max()) < n  # its own tokens only, as many as the budget allows
        if n > 40:  # the 40 best of its own tokens
            assert torch.equal(idx, scores[head, :n].topk(40).indices.sort().values)
    recent = keep_top(scores, 40, recent=4, lengths=lengths)
    assert all(idx[-4:].tolist() == list(range(n - 4, n)) for idx, n in zip(recent, lengths) if n > 40)
