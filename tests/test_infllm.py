"""InfLLM: block memory in host memory, representative keys, LRU device cache of blocks (tiny random models)."""

from __future__ import annotations

import pytest
import torch
from conftest import random_ids
from test_retrieval_methods import kv_turns

from kvbench.engine.config import EngineConfig
from kvbench.engine.sample import run_sample
from kvbench.engine.session import Session
from kvbench.methods import build_method
from kvbench.methods.common.blocks import rope, unrope
from kvbench.methods.infllm import BlockCache

PROMPT = 400
SMALL = {"n_init": 8, "n_local": 40, "memory_block_size": 32, "topk": 3}  # 11 blocks after the prompt


def decode(session: Session, logits: torch.Tensor, steps: int) -> list[torch.Tensor]:
    outs = [logits]
    for _ in range(steps):
        outs.append(session.step(int(outs[-1].argmax())))
    return outs


def dense_run(lm, ids, steps):
    session = Session(lm, build_method("full"), None)
    return session, decode(session, session.prefill(ids, compress=True)[0], steps)


def every_position_once(session: Session) -> None:
    """Storage and block memory together hold every position exactly once, in every head of every layer."""
    for layer in session.cache.layers:
        memory = layer.derived.get("infllm_memory")
        held = [] if memory is None else [s + i for s, n in zip(memory.starts.tolist(), memory.lengths.tolist())
                                           for i in range(n)]
        for h in range(layer.num_heads):
            positions = sorted(layer.head_view().positions[h].tolist() + held)
            assert positions == list(range(layer.seen)), f"layer {layer.layer_idx} head {h} lost or doubled a token"


@pytest.mark.parametrize("memory_positions", ["infllm", "exact"])
def test_budget_at_or_above_the_sequence_is_bitwise_full(tiny, memory_positions):
    ids = random_ids(PROMPT, seed=80)
    session = Session(tiny, build_method("infllm", **SMALL, memory_positions=memory_positions), PROMPT + 6,
                      sequence_length=PROMPT + 6)
    assert session.plan.derived == {"full_attention": True}
    outs = decode(session, session.prefill(ids, compress=True)[0], 6)
    assert all(torch.equal(a, b) for a, b in zip(outs, dense_run(tiny, ids, 6)[1]))


def test_no_token_is_dropped_after_prefill_decode_and_a_rollback(tiny_llama):
    session = Session(tiny_llama, build_method("infllm", **SMALL), 200, sequence_length=PROMPT + 100)
    logits = session.prefill(random_ids(PROMPT, seed=81), compress=True)[0]
    every_position_once(session)
    layer = session.cache.layers[0]
    assert layer.derived["infllm_memory"].blocks == 11 and layer.lengths() == [8 + 40] * 2  # init + window
    decode(session, logits, 80)  # 80 tokens leave the window: two more blocks, the second after the prompt's end
    every_position_once(session)
    assert layer.derived["infllm_memory"].starts.tolist()[-2:] == [360, 392]
    window = set(range(PROMPT + 80 - 40, PROMPT + 80))
    assert window <= set(layer.positions[0].tolist())  # the local window stays resident
    session.rollback(PROMPT)  # cuts the block 392..423 to its first 8 rows
    every_position_once(session)
    assert layer.derived["infllm_memory"].lengths.tolist()[-1] == 8
    decode(session, session.step(5), 20)
    every_position_once(session)


def test_topk_covering_every_block_with_exact_positions_is_full_attention(tiny):
    ids = random_ids(PROMPT, seed=82)
    method = build_method("infllm", **{**SMALL, "topk": 20}, memory_positions="exact")
    session = Session(tiny, method, 200, sequence_length=PROMPT + 50)
    outs = decode(session, session.prefill(ids, compress=True)[0], 40)  # blocks also form while decoding
    assert session.cache.layers[1].derived["infllm_memory"].blocks == 12
    for ours, theirs in zip(outs, dense_run(tiny, ids, 40)[1]):
        torch.testing.assert_close(ours, theirs, atol=5e-5, rtol=1e-5)


def spy(method, name: str) -> list:
    seen, original = [], getattr(method, name)

    def wrapper(layer, q, view, step, scaling):
        out = original(layer, q, view, step, scaling)
        seen.append((layer.layer_idx, q.clone(), view.positions[0].clone(), out))
        return out

    setattr(method, name, wrapper)
    return seen


def test_infllm_positions_put_every_token_beyond_the_window_at_its_far_edge(tiny_llama):
    """The repo's positions: init, remainder and retrieved blocks attend as if at distance n_local - 1."""
    ids = random_ids(PROMPT, seed=83)
    dense, _ = dense_run(tiny_llama, ids, 4)
    method = build_method("infllm", **{**SMALL, "topk": 11})
    seen = spy(method, "select")
    session = Session(tiny_llama, method, 200, sequence_length=PROMPT + 10)
    decode(session, session.prefill(ids, compress=True)[0], 4)
    assert len(seen) == 4 * 2
    for layer_idx, _, positions, sel in seen:
        layer, full = session.cache.layers[layer_idx], dense.cache.layers[layer_idx]
        p = int(positions.max())
        window = positions > p - 40
        memory = layer.derived["infllm_memory"]
        outer = positions[~window].tolist() + [s + i for s in memory.starts.tolist() for i in range(32)]
        view = full.head_view()
        exact = view.keys[:, outer]
        expected = rope(unrope(exact, view.positions[:, outer], session.rotary),
                        torch.full((2, len(outer)), p - 40 + 1), session.rotary)
        torch.testing.assert_close(sel.external[0], expected, atol=1e-4, rtol=1e-4)
        assert torch.equal(sel.external[1], view.values[:, outer])
        assert sel.idx[0, 0].tolist() == torch.nonzero(window).flatten().tolist()  # the window, own positions


def test_representatives_are_the_mean_key_of_the_tokens_with_the_highest_local_score(tiny_llama):
    method = build_method("infllm", **SMALL)
    queries = []
    observe = method.observe

    def spy_observe(layer, q, step):
        queries.append((layer.layer_idx, q.clone()))
        return observe(layer, q, step)

    method.observe = spy_observe
    session = Session(tiny_llama, method, 200, sequence_length=PROMPT + 10)
    session.prefill(random_ids(PROMPT, seed=84), compress=True)
    dense, _ = dense_run(tiny_llama, random_ids(PROMPT, seed=84), 0)
    assert [layer_idx for layer_idx, _ in queries] == [0, 1]
    for layer_idx, q in queries:
        layer, full = session.cache.layers[layer_idx], dense.cache.layers[layer_idx]
        keys = full.head_view().keys  # [2, n, 16]
        logits = torch.einsum("hgqd,hkd->hgqk", q.view(2, 2, PROMPT, 16), keys) * layer.scaling
        dist = torch.arange(PROMPT)[:, None] - torch.arange(PROMPT)[None, :]
        probs = torch.softmax(logits.masked_fill(dist < 0, float("-inf")), -1)
        score = (probs * (dist < 40)).sum(2)  # [H, G, n]: from the 40 queries whose window holds the token
        pre = unrope(keys, full.head_view().positions, session.rotary)
        reprs = layer.derived["infllm_reprs"].reprs  # [B, H, G, D]
        for b, start in enumerate(layer.derived["infllm_memory"].starts.tolist()):
            top = score[:, :, start:start + 32].topk(4, dim=-1).indices + start  # [H, G, 4]
            expected = torch.stack([torch.stack([pre[h, top[h, g]].mean(0) for g in range(2)]) for h in range(2)])
            torch.testing.assert_close(reprs[b], expected, atol=1e-4, rtol=1e-4)


def test_blocks_are_chosen_by_the_query_against_representatives_summed_over_every_head(tiny_llama):
    method = build_method("infllm", **SMALL, memory_positions="exact")
    seen = spy(method, "select")
    tops = []
    top_blocks = method._top_blocks
    method._top_blocks = lambda *args: tops.append(top_blocks(*args)) or tops[-1]
    session = Session(tiny_llama, method, 200, sequence_length=PROMPT + 10)
    decode(session, session.prefill(random_ids(PROMPT, seed=85), compress=True)[0], 3)
    assert len(tops) == len(seen) == 3 * 2
    for (layer_idx, q, _, sel), (chosen, scored) in zip(seen, tops):
        reprs = session.cache.layers[layer_idx].derived["infllm_reprs"].reprs
        score = torch.einsum("hgd,bhgd->b", q, reprs)
        assert scored == 11 and sorted(chosen) == sorted(score.topk(3).indices.tolist())
        assert sel.extra["retrieved_blocks"] == 3 and sel.extra["cache_hits"] + sel.extra["cache_misses"] == 3


def test_infllm_positions_score_blocks_with_the_query_at_the_windows_far_edge(tiny_llama):
    """The repo rotates the query to n_local - 1 against unrotated representatives: the same scores as the
    decode query against representatives rotated to p - n_local + 1, where the memory's keys attend."""
    method = build_method("infllm", **SMALL)
    seen = spy(method, "select")
    tops = []
    top_blocks = method._top_blocks
    method._top_blocks = lambda *args: tops.append(top_blocks(*args)) or tops[-1]
    session = Session(tiny_llama, method, 200, sequence_length=PROMPT + 10)
    decode(session, session.prefill(random_ids(PROMPT, seed=88), compress=True)[0], 3)
    assert len(tops) == len(seen) == 3 * 2
    for (layer_idx, q, positions, _), (chosen, _) in zip(seen, tops):
        reprs = session.cache.layers[layer_idx].derived["infllm_reprs"].reprs  # [B, H, G, D], pre-RoPE
        target = torch.full(reprs.shape[:3], int(positions.max()) - 40 + 1)
        score = torch.einsum("hgd,bhgd->b", q, rope(reprs, target, session.rotary))
        assert sorted(chosen) == sorted(score.topk(3).indices.tolist())


def test_the_lru_cache_holds_its_capacity_hits_reused_blocks_and_evicts_the_least_recently_used():
    cache = BlockCache(capacity=3)
    assert cache.load([0, 1]) == (0, 2)
    assert cache.load([1, 2]) == (1, 1)  # block 1 is a hit
    assert cache.load([3]) == (0, 1) and set(cache.last_use) == {1, 2, 3}  # 0 was used least recently
    assert cache.load([2]) == (1, 0)
    assert cache.load([0]) == (0, 1) and set(cache.last_use) == {2, 3, 0}  # 1 (used before 2 and 3)
    assert cache.load([4, 5, 0]) == (1, 2) and set(cache.last_use) == {4, 5, 0}  # the needed blocks stay
    fork = cache.fork()
    fork.load([6])
    assert set(cache.last_use) == {4, 5, 0}  # a copy of the cache forks it


def test_lru_capacity_holds_through_a_run_and_the_record_counts_hits_and_misses(tiny_llama):
    method = build_method("infllm", **SMALL, max_cached_blocks=4)
    session = Session(tiny_llama, method, 200, sequence_length=PROMPT + 30)
    logits = session.prefill(random_ids(PROMPT, seed=86), compress=True)[0]
    for _ in range(20):
        logits = session.step(int(logits.argmax()))
        assert all(len(layer.derived["infllm_cache"].last_use) <= 4 for layer in session.cache.layers)
    stats = session.cache.stats
    per_step = {k: v / stats.extra_steps for k, v in stats.extra_sums.items()}
    assert per_step["retrieved_blocks"] == 3 and per_step["cache_hits"] + per_step["cache_misses"] == 3
    assert per_step["cache_hits"] > 0  # consecutive steps reuse blocks


def test_blocks_live_in_host_bytes_and_the_run_records_it(tiny):
    record = run_sample(tiny, build_method("infllm", **{**SMALL, "topk": 2}), 160, kv_turns(2), EngineConfig(nll=False))
    assert len(record["turns"]) == 2 and record["topk_recall"] is not None
    assert record["host_bytes_end"] > 0 and record["device_bytes_end"] > 0
    assert record["storage_ratio_table1"] > 0.9  # nothing is dropped
    assert 100 < record["decode_read_tokens_per_group"] < 200  # init + remainder + window + 2 blocks + reprs
    agnostic = run_sample(tiny, build_method("infllm", **SMALL), 160, kv_turns(1), EngineConfig(compress_question=False))
    assert agnostic["nll"] is not None and agnostic["decode_method_stats"]["retrieved_blocks"] == 3


def test_the_budget_maps_to_init_window_and_blocks_as_the_repos_proportions():
    plan = build_method("infllm").plan(6272, sequence_length=100_000, new_tokens=0, head_dim=128)
    assert {k: plan.derived[k] for k in ("n_init", "n_local", "topk", "cached_blocks")} == \
        {"n_init": 128, "n_local": 4096, "topk": 16, "cached_blocks": 32}  # the repo's configuration
    small = build_method("infllm").plan(1024, sequence_length=100_000, new_tokens=0, head_dim=128).derived
    assert small["attended"] == 1024 and small["topk"] == 2 and small["n_init"] == 128
    with pytest.raises(ValueError, match="max_cached_blocks"):
        build_method("infllm", topk=4, max_cached_blocks=3).plan(2048, sequence_length=9000, new_tokens=0, head_dim=8)


def test_infllm_positions_refuse_a_model_without_rope(tiny_llama):
    session = Session(tiny_llama, build_method("infllm", **SMALL), 200, sequence_length=PROMPT + 8)
    session.rotary = None
    with pytest.raises(ValueError, match="rotary"):
        session.prefill(random_ids(PROMPT, seed=87), compress=True)
