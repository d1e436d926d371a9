"""The common KV-cache interface and the first five methods, on tiny random Llama and Qwen3 models."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from conftest import random_ids
from reference import kept_masks, reference_logits
from transformers import DynamicCache

from kvbench.engine.session import Session
from kvbench.methods import build_method
from kvbench.methods.adakv import allocate
from kvbench.methods.snapkv import window_scores
from kvbench.models import cache_kwargs

PROMPT = 300


@torch.inference_mode()
def stock_logits(lm, ids: list[int], steps: int) -> tuple[list[torch.Tensor], list[int]]:
    """transformers' own SDPA attention + DynamicCache, greedy."""
    model = lm.model
    model.set_attn_implementation("sdpa")
    try:
        cache = DynamicCache(config=model.config)
        out = model(input_ids=torch.tensor([ids]), **cache_kwargs(model, cache), use_cache=True,
                    logits_to_keep=1)
        logits, tokens = [out.logits[0, -1]], []
        for _ in range(steps):
            tokens.append(int(logits[-1].argmax()))
            out = model(input_ids=torch.tensor([[tokens[-1]]]), **cache_kwargs(model, cache), use_cache=True)
            logits.append(out.logits[0, -1])
        return logits, tokens
    finally:
        model.set_attn_implementation("kvbench")


def run_session(lm, method: str, budget: int, ids: list[int], steps: int, question: list[int] | None = None, **params):
    session = Session(lm, build_method(method, **params), budget)
    logits, _ = session.prefill(ids, compress=True)
    if question:
        logits, _ = session.prefill(question, compress=False)
    outs, tokens = [logits], []
    for _ in range(steps):
        tokens.append(int(outs[-1].argmax()))
        outs.append(session.forward([tokens[-1]])[-1])
    return session, outs, tokens


@pytest.mark.parametrize("method", ["full", "streamingllm", "snapkv", "adakv", "exact_topk"])
def test_budget_at_or_above_context_is_bitwise_full(tiny, method):
    ids = random_ids(PROMPT)
    ref, _ = stock_logits(tiny, ids, steps=6)
    session, outs, _ = run_session(tiny, method, budget=PROMPT + 6, ids=ids, steps=6)
    assert all(torch.equal(a.float(), b.float()) for a, b in zip(outs, ref))
    assert all(n == PROMPT + 6 for layer in session.cache.kept_per_head() for n in layer)


@pytest.mark.parametrize(
    "method,params",
    [("streamingllm", {}), ("snapkv", {"window": 8}), ("adakv", {"window": 8}), ("snapkv", {"window": 8, "pooling": "avg"})],
)
def test_logits_after_eviction_match_dense_reference_on_kept_tokens(tiny, method, params):
    ids = random_ids(PROMPT, seed=1)
    session, outs, tokens = run_session(tiny, method, budget=48, ids=ids, steps=6, **params)
    visible = kept_masks(session.cache, PROMPT)
    assert all(int(m.sum(-1).max()) < PROMPT for m in visible.values())  # something was evicted
    ref = reference_logits(tiny.model, ids, visible, [[t] for t in tokens])
    for ours, theirs in zip(outs, ref):
        torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-5)
    uncompressed, _ = stock_logits(tiny, ids, steps=6)
    assert max(float((a - b.float()).abs().max()) for a, b in zip(outs[1:], uncompressed[1:])) > 1e-3


def test_question_agnostic_chunk_attends_compressed_context(tiny):
    ids, question = random_ids(PROMPT, seed=2), random_ids(20, seed=3)
    session, outs, tokens = run_session(tiny, "adakv", budget=40, ids=ids, steps=4, question=question, window=8)
    visible = kept_masks(session.cache, PROMPT)
    ref = reference_logits(tiny.model, ids, visible, [question] + [[t] for t in tokens])
    for ours, theirs in zip(outs, ref[1:]):
        torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-5)


def test_chunked_prefill_without_compression_matches_one_shot(tiny):
    ids = random_ids(PROMPT, seed=4)
    one_shot, _ = stock_logits(tiny, ids, steps=0)
    session = Session(tiny, build_method("full"), None)
    session.prefill(ids[:200], compress=False)
    logits, _ = session.prefill(ids[200:], compress=False)
    torch.testing.assert_close(logits, one_shot[0].float(), atol=2e-5, rtol=1e-5)


def test_snapkv_keeps_observation_window_and_budget(tiny):
    ids = random_ids(PROMPT, seed=5)
    session, _, _ = run_session(tiny, "snapkv", budget=40, ids=ids, steps=0, window=8)
    for layer in session.cache.layers:
        assert layer.lengths() == [40] * layer.num_heads
        for head_positions in layer.head_view().positions:
            assert set(range(PROMPT - 8, PROMPT)) <= set(head_positions.tolist())
            assert head_positions.tolist() == sorted(head_positions.tolist())


def test_adakv_budgets_sum_to_layer_budget_with_alpha_floor_and_free_memory(tiny):
    ids = random_ids(PROMPT, seed=6)
    budget, window, alpha = 40, 8, 0.2
    session = Session(tiny, build_method("full"), None)
    session.prefill(ids, compress=False)
    full_bytes = session.cache.kv_bytes()

    session = Session(tiny, build_method("adakv", window=window, alpha=alpha), budget)
    session.query_window = window
    session.prefill(ids, compress=False)
    dense_keys = [weakref.ref(layer.buffers["keys"]) for layer in session.cache.layers]
    session.evict_deferred()
    gc.collect()
    assert all(ref() is None for ref in dense_keys), "evicted K/V storage must be released"

    floor = int(alpha * (budget - window)) + window
    ragged = False
    for layer in session.cache.layers:
        lens = layer.lengths()
        assert sum(lens) == budget * layer.num_heads
        assert min(lens) >= floor
        ragged |= len(set(lens)) > 1
        if layer.is_ragged:
            assert layer.keys.shape == (sum(lens), layer.head_dim)  # flattened: no padding held
    assert ragged, "random heads should get different budgets"
    held = session.cache.kv_bytes()
    expected = sum(sum(layer.lengths()) for layer in session.cache.layers) * 2 * 16 * 4
    assert held == expected
    assert held < full_bytes * budget / PROMPT * 1.01


def test_inline_and_deferred_eviction_agree(tiny):
    ids = random_ids(PROMPT, seed=7)
    inline = Session(tiny, build_method("adakv", window=8), 50)
    logits_inline, _ = inline.prefill(ids, compress=True)
    deferred = Session(tiny, build_method("adakv", window=8), 50)
    deferred.query_window = 32
    logits_deferred, _ = deferred.prefill(ids, compress=False)
    deferred.evict_deferred()
    assert deferred.cache.kept_per_head() == inline.cache.kept_per_head()
    for a, b in zip(inline.cache.layers, deferred.cache.layers):
        assert torch.equal(a.positions, b.positions) and torch.equal(a.keys, b.keys)
    assert torch.equal(logits_inline, logits_deferred)
    for _ in range(4):
        token = int(logits_inline.argmax())
        logits_inline, logits_deferred = inline.forward([token])[-1], deferred.forward([token])[-1]
        assert torch.equal(logits_inline, logits_deferred)


def test_exact_topk_full_budget_matches_full_and_small_budget_matches_masked_reference(tiny):
    ids = random_ids(PROMPT, seed=8)
    full, outs_full, _ = run_session(tiny, "full", budget=PROMPT, ids=ids, steps=3)
    # forcing the gather path with k = cache length changes only the summation order
    session = Session(tiny, build_method("exact_topk"), PROMPT + 10)
    logits, _ = session.prefill(ids, compress=True)
    # take the gather path with k = the cache length: select every token instead of short-circuiting
    method = session.method
    method.select = lambda layer, q, view, plan, scaling: torch.arange(view.keys.shape[1]).expand(*q.shape[:2], -1)
    outs = [logits]
    for _ in range(3):
        outs.append(session.forward([int(outs[-1].argmax())])[-1])
    for a, b in zip(outs, outs_full):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)

    # small k: each query head attends exactly to its own top-k keys
    k = 16
    session = Session(tiny, build_method("exact_topk"), k)
    session.prefill(ids, compress=True)
    layer = session.cache.layers[0]
    q = torch.randn(layer.num_heads, 2, layer.head_dim)
    view = layer.head_view()
    idx = session.method.select(layer, q, view, session.step_context(), 0.25)
    from kvbench.kernels.sparse_attention import topk_attention

    ours = topk_attention(q, view.keys, view.values, idx, 0.25)
    logits = torch.einsum("hgd,hld->hgl", q, view.keys) * 0.25
    mask = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, idx, True)
    assert torch.equal(mask.sum(-1), torch.full(mask.shape[:2], k))
    assert torch.equal(logits.masked_fill(~mask, float("-inf")).topk(k, -1).indices.sort(-1).values, idx.sort(-1).values)
    probs = torch.softmax(logits.masked_fill(~mask, float("-inf")), -1)
    ref = torch.einsum("hgl,hld->hgd", probs, view.values)
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-5)


def test_exact_topk_group_granularity_shares_selection(tiny):
    ids = random_ids(120, seed=9)
    session = Session(tiny, build_method("exact_topk", granularity="group"), 8)
    session.prefill(ids, compress=True)
    layer = session.cache.layers[1]
    idx = session.method.select(layer, torch.randn(layer.num_heads, 2, layer.head_dim), layer.head_view(),
                                session.step_context(), 0.25)
    assert torch.equal(idx[:, 0], idx[:, 1])


def test_allocation_toy_example_from_adakv_figure_2():
    scores = torch.tensor(
        [[0.32, 0.01, 0.18, 0.08, 0.22, 0.19], [0.89, 0.01, 0.05, 0.02, 0.01, 0.02], [0.68, 0.01, 0.08, 0.04, 0.09, 0.10]]
    )
    budgets = allocate(scores, 6, alpha=0.0)
    assert budgets == [4, 1, 1]
    kept = sum(float(s.topk(b).values.sum()) for s, b in zip(scores, budgets))
    uniform = sum(float(s.topk(2).values.sum()) for s in scores)
    assert kept == pytest.approx(2.48) and uniform == pytest.approx(2.26)


def test_adaptive_allocation_retains_at_least_uniform_mass_and_floor_holds():
    gen = torch.Generator().manual_seed(0)
    for trial in range(20):
        scores = torch.rand(8, 200, generator=gen) ** (1 + trial % 5)
        b = 12
        masses = {}
        for alpha in (0.0, 0.2, 0.5, 1.0):
            budgets = allocate(scores, 8 * b, alpha)
            assert sum(budgets) == 8 * b and min(budgets) >= int(alpha * b)
            masses[alpha] = sum(float(s.topk(n).values.sum()) for s, n in zip(scores, budgets))
        assert masses[0.0] >= masses[0.2] - 1e-6 >= masses[0.5] - 2e-6 >= masses[1.0] - 3e-6


def test_window_scores_are_causal_inside_the_window():
    keys = torch.randn(1, 10, 4)
    q = torch.randn(2, 3, 4)
    scores = window_scores(q, keys, 0.5)
    # reference: each window query i at position 7+i sees keys 0..7+i; mean over window and group
    logits = torch.einsum("gwd,ld->gwl", q, keys[0]) * 0.5
    for i in range(3):
        logits[:, i, 8 + i:] = float("-inf")
    expected = torch.softmax(logits, -1)[..., :7].mean(1).mean(0)
    torch.testing.assert_close(scores[0], expected)


def test_truncate_rolls_back_to_logical_length(tiny):
    ids = random_ids(100, seed=10)
    session = Session(tiny, build_method("snapkv", window=8), 30)
    session.prefill(ids, compress=True)
    for t in (5, 6, 7):
        session.forward([t])
    session.rollback(100)
    assert session.position == 100
    for layer in session.cache.layers:
        assert layer.lengths() == [30] * layer.num_heads
        assert int(layer.positions.max()) < 100


def test_snapkv_scores_equal_the_models_own_attention_weights(tiny):
    """The observation-window scores are exactly the model's attention probabilities (eager attention with
    output_attentions), averaged over the window and the GQA group: RoPE, head order and scale are right."""
    ids = random_ids(120, seed=11)
    window = 8
    session = Session(tiny, build_method("full"), None)
    session.query_window = window
    session.prefill(ids, compress=False)
    model = tiny.model
    model.set_attn_implementation("eager")
    try:
        with torch.inference_mode():
            attentions = model(input_ids=torch.tensor([ids]), output_attentions=True, use_cache=False).attentions
    finally:
        model.set_attn_implementation("kvbench")
    for layer, att in zip(session.cache.layers, attentions):
        ours = window_scores(layer.queries, layer.head_view().keys, layer.scaling)
        n_kv = layer.num_heads
        theirs = att[0, :, -window:, : len(ids) - window].float().mean(1).view(n_kv, -1, len(ids) - window).mean(1)
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)


def test_kvpress_allocation_protects_each_heads_top_then_prunes_globally():
    from kvbench.methods.adakv import allocate_kvpress

    inf = float("inf")
    # 3 heads x 8 tokens, the last 2 the window; budget 4 per head, alpha 0.5 -> 2 protected per head
    scores = torch.tensor([[0.9, 0.8, 0.7, 0.6, 0.5, 0.4, inf, inf],
                           [0.05, 0.04, 0.03, 0.02, 0.01, 0.0, inf, inf],
                           [0.3, 0.2, 0.1, 0.85, 0.75, 0.65, inf, inf]])
    kept = allocate_kvpress(scores, budget=4, alpha=0.5)
    # protected: each head's top 2 = its window. Global top 12: 6 window tokens + the 6 best of the rest:
    # 0.9, 0.85, 0.8, 0.75, 0.7, 0.65 -> head 0 keeps 3, head 1 none, head 2 three
    assert [k.tolist() for k in kept] == [[0, 1, 2, 6, 7], [6, 7], [3, 4, 5, 6, 7]]
    assert sum(len(k) for k in kept) == 12
    # with alpha = 1 every head keeps exactly its own top 4 (the floor is the whole budget)
    assert [len(k) for k in allocate_kvpress(scores, budget=4, alpha=1.0)] == [4, 4, 4]


def test_kvpress_allocation_on_a_model_keeps_the_layer_total_and_the_floor(tiny):
    ids = random_ids(PROMPT, seed=12)
    session = Session(tiny, build_method("adakv", window=8, allocation="kvpress"), 40)
    session.prefill(ids, compress=True)
    for layer in session.cache.layers:
        lens = layer.lengths()
        assert sum(lens) == 40 * layer.num_heads and min(lens) >= max(8, int(0.2 * 40))
        for positions in layer.head_view().positions:
            assert set(range(PROMPT - 8, PROMPT)) <= set(positions[positions >= 0].tolist())


def test_exact_topk_group_max_is_flat_the_top_of_the_groups_max_softmax(tiny_llama):
    """CTKVR's FLAT: one selection per KV group, the exact top-k of the max over the group's softmaxes."""
    session = Session(tiny_llama, build_method("exact_topk", granularity="group_max"), 8)
    session.prefill(random_ids(120, seed=10), compress=True)
    layer = session.cache.layers[1]
    q = torch.randn(layer.num_heads, 2, layer.head_dim)
    view = layer.head_view()
    idx = session.method.select(layer, q, view, session.step_context(), 0.25)
    probs = torch.softmax(torch.einsum("hgd,hld->hgl", q, view.keys) * 0.25, dim=-1).amax(dim=1)
    expected = probs.topk(8, dim=-1).indices
    assert torch.equal(idx[:, 0].sort(-1).values, expected.sort(-1).values) and torch.equal(idx[:, 0], idx[:, 1])
