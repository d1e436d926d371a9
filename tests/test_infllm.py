"""InfLLM: block memory in host memory, representative keys, LRU device cache of blocks, the chunked prefill
through that memory (tiny random models)."""

from __future__ import annotations

import pytest
import torch
from conftest import CONF, random_ids
from test_retrieval_methods import kv_turns

from kvbench.engine.config import EngineConfig
from kvbench.engine.sample import run_sample
from kvbench.engine.session import Session
from kvbench.methods import build_method
from kvbench.methods.common.blocks import rope, unrope
from kvbench.methods.infllm import BlockCache

PROMPT = 400
# 11 blocks after the prompt; prefill chunks of 32 (<= n_local, as the repo requires of exc_block_size)
SMALL = {"n_init": 8, "n_local": 40, "memory_block_size": 32, "topk": 3, "prefill_chunk": 32}


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
def test_budget_at_or_above_the_sequence_is_full_attention(tiny, memory_positions):
    """Bitwise `full` with the dense prefill; the chunked one is the same attention in chunks (rounded so)."""
    ids = random_ids(PROMPT, seed=80)
    dense = dense_run(tiny, ids, 6)[1]
    for prefill in ("dense", "chunked"):
        session = Session(tiny, build_method("infllm", **SMALL, memory_positions=memory_positions, prefill=prefill),
                          PROMPT + 6, sequence_length=PROMPT + 6)
        assert session.plan.derived == {"full_attention": True}
        outs = decode(session, session.prefill(ids, compress=True)[0], 6)
        if prefill == "dense":
            assert all(torch.equal(a, b) for a, b in zip(outs, dense))
        for a, b in zip(outs, dense):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


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
    method = build_method("infllm", **{**SMALL, "topk": 11}, prefill="dense")  # the dense run's keys: dense prefill
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
    """`prefill=dense`: a token's local score is its dense attention probability from the queries whose window
    holds it (the chunked prefill's scores: test_chunked_prefill_attends_init_retrieved_blocks_and_window_only)."""
    method = build_method("infllm", **SMALL, prefill="dense")
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


def spied_decode(lm, method, seed: int, steps: int):
    """Prefill, then `steps` decode steps with `select` and `_top_blocks` spied (the prefill's chunks choose blocks
    too: only the decode steps' choices are collected)."""
    session = Session(lm, method, 200, sequence_length=PROMPT + 10)
    logits = session.prefill(random_ids(PROMPT, seed=seed), compress=True)[0]
    seen, tops = spy(method, "select"), []
    top_blocks = method._top_blocks
    method._top_blocks = lambda *args: tops.append(top_blocks(*args)) or tops[-1]
    decode(session, logits, steps)
    return session, seen, tops


def test_blocks_are_chosen_by_the_query_against_representatives_summed_over_every_head(tiny_llama):
    method = build_method("infllm", **SMALL, memory_positions="exact")
    session, seen, tops = spied_decode(tiny_llama, method, 85, 3)
    assert len(tops) == len(seen) == 3 * 2
    for (layer_idx, q, _, sel), (chosen, scored) in zip(seen, tops):
        reprs = session.cache.layers[layer_idx].derived["infllm_reprs"].reprs
        score = torch.einsum("hgd,bhgd->b", q, reprs)
        assert scored == 11 and sorted(chosen) == sorted(score.topk(3).indices.tolist())
        assert sel.extra["retrieved_blocks"] == 3 and sel.extra["cache_hits"] + sel.extra["cache_misses"] == 3


def test_infllm_positions_score_blocks_with_the_query_at_the_windows_far_edge(tiny_llama):
    """The repo rotates the query to n_local - 1 against unrotated representatives: the same scores as the
    decode query against representatives rotated to p - n_local + 1, where the memory's keys attend."""
    session, seen, tops = spied_decode(tiny_llama, build_method("infllm", **SMALL), 88, 3)
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


def prefill_calls(method, layer_idx: int = 0) -> list[dict]:
    """Spy `chunk_attention` on one layer: each call's query, the positions stored, the memory's blocks and the
    blocks the chunk retrieved, and the output (None: the dispatcher's dense attention)."""
    calls, original, top_blocks = [], method.chunk_attention, method._top_blocks

    def chosen(*args):
        calls[-1]["chosen"] = top_blocks(*args)[0]
        return top_blocks(*args)

    def wrapper(layer, query, step, scaling):
        if layer.layer_idx != layer_idx:
            return original(layer, query, step, scaling)
        memory = layer.derived.get("infllm_memory")
        calls.append({"q": query.clone(), "seen": layer.seen, "stored": layer.head_view().positions[0].clone(),
                      "blocks": [] if memory is None else list(zip(memory.starts.tolist(), memory.lengths.tolist())),
                      "chosen": []})
        method._top_blocks = chosen
        calls[-1]["out"] = original(layer, query, step, scaling)
        method._top_blocks = top_blocks
        return calls[-1]["out"]

    method.chunk_attention = wrapper
    return calls


@pytest.mark.parametrize("memory_positions", ["infllm", "exact"])
def test_chunked_prefill_attends_init_retrieved_blocks_and_window_only(tiny_llama, memory_positions):
    """Every prefill chunk past the local window attends, row by row, to the rows it may see of what is stored
    (initial tokens, the remainder, its window, the chunk itself) and to the blocks the chunk retrieved, nothing
    else: its output is the attention over exactly that set (layer 0, whose keys and values a dense run gives),
    with the window at its own positions and the rest at the window's far edge (`infllm`) or its own (`exact`)."""
    ids = random_ids(PROMPT, seed=89)
    dense, _ = dense_run(tiny_llama, ids, 0)
    full = dense.cache.layers[0].head_view()
    method = build_method("infllm", **SMALL, memory_positions=memory_positions)
    calls = prefill_calls(method)
    session = Session(tiny_llama, method, 200, sequence_length=PROMPT + 10)
    session.prefill(ids, compress=True)
    rotary, local, scaling = session.rotary, SMALL["n_local"], session.cache.layers[0].scaling
    assert len(calls) == PROMPT // SMALL["prefill_chunk"] + 1  # 12 chunks of 32 and one of 16
    assert calls[0]["out"] is None  # the first chunk is within every row's window: dense causal attention
    excluded = 0
    for call in calls[1:]:
        n = call["q"].shape[1]
        q = call["q"].view(2, 2, n, 16)
        held = set(call["stored"].tolist())
        retrieved = {s + i for b in call["chosen"] for s, length in [call["blocks"][b]] for i in range(length)}
        assert not held & retrieved
        outs = []
        for row in range(n):
            p = call["seen"] - n + row
            seen_rows = sorted(k for k in held | retrieved if k <= p)
            # the window, the initial tokens, the remainder and the retrieved blocks: never the blocks left out
            assert len(seen_rows) <= SMALL["n_init"] + local + SMALL["memory_block_size"] * (SMALL["topk"] + 1) + n
            keys = full.keys[:, seen_rows]
            far = torch.tensor([p - k >= local for k in seen_rows])
            if memory_positions == "infllm":
                moved = rope(unrope(keys, full.positions[:, seen_rows], rotary),
                             torch.full((2, len(seen_rows)), p - local + 1), rotary)
                keys = torch.where(far[None, :, None], moved, keys)
            probs = torch.softmax(torch.einsum("hgd,hkd->hgk", q[:, :, row], keys) * scaling, dim=-1)
            outs.append(torch.einsum("hgk,hkd->hgd", probs, full.values[:, seen_rows]))
            excluded += p + 1 - len(seen_rows)
        expected = torch.stack(outs, dim=2).reshape(4, n, 16)
        torch.testing.assert_close(call["out"], expected, atol=1e-4, rtol=1e-4)
    assert excluded > 0 and any(len(c["blocks"]) > SMALL["topk"] for c in calls)  # retrieval left rows out


def test_chunked_prefill_holds_init_remainder_window_and_one_chunk_at_most(tiny_llama):
    method = build_method("infllm", **SMALL)
    session = Session(tiny_llama, method, 200, sequence_length=PROMPT + 10)
    session.prefill(random_ids(PROMPT, seed=90), compress=True)
    bound = SMALL["n_init"] + SMALL["memory_block_size"] - 1 + SMALL["n_local"] + SMALL["prefill_chunk"]
    assert session.cache.peak_entries_per_head() <= bound < PROMPT
    dense = Session(tiny_llama, build_method("infllm", **SMALL, prefill="dense"), 200, sequence_length=PROMPT + 10)
    dense.prefill(random_ids(PROMPT, seed=90), compress=True)
    assert dense.cache.peak_entries_per_head() == PROMPT  # kvbench's dense prefill holds the whole prompt first


def test_the_last_prompt_token_runs_as_a_decode_step_with_chunked_prefill(tiny_llama):
    """The repo's GreedySearch: the prompt but its last token in chunks, that token alone (a decode step, which
    retrieves blocks with its own query); `prefill=dense` keeps kvbench's one dense pass."""
    assert build_method("infllm").schedule().block_size == 512
    assert build_method("infllm", prefill="dense").schedule().block_size is None
    for prefill, first_step in (("chunked", -1), ("dense", 0)):
        method = build_method("infllm", **SMALL, prefill=prefill)
        assert method.last_prompt_token_via_decode == (prefill == "chunked")
        seen = spy(method, "select")
        record = run_sample(tiny_llama, method, 200, kv_turns(1), EngineConfig(nll=False, topk_recall=False))
        steps = sorted({int(s[2].max()) for s in seen})
        assert record["prompt_tokens"] + first_step in steps and steps[-1] < record["prompt_tokens"] + 6
        if prefill == "dense":
            assert steps[0] == record["prompt_tokens"]  # no decode-path step before the first generated token


def test_recall_is_over_the_block_memory_what_retrieval_chose(tiny_llama):
    """`topk_recall`: the full attention's mass on the retrieved blocks' rows over the mass of as many of the
    memory's best rows (the resident rows count neither way); 1 when every block is retrieved."""
    ids = random_ids(PROMPT, seed=91)
    for memory_positions in ("infllm", "exact"):
        every = Session(tiny_llama, build_method("infllm", **{**SMALL, "topk": 20}, memory_positions=memory_positions),
                        200, sequence_length=PROMPT + 10)
        every.measure_recall = True
        decode(every, every.prefill(ids, compress=True)[0], 3)
        assert every.cache.stats.recall_sum / every.cache.stats.recall_steps == pytest.approx(1.0)
    method = build_method("infllm", **SMALL, memory_positions="exact")
    calls, original = [], method._recall

    def spy_recall(q, view, memory, chosen, step, scaling):
        calls.append((q, view.keys.clone(), memory, list(chosen), scaling, original(q, view, memory, chosen, step,
                                                                                     scaling)))
        return calls[-1][-1]

    method._recall = spy_recall
    session = Session(tiny_llama, method, 200, sequence_length=PROMPT + 10)
    session.measure_recall = True
    decode(session, session.prefill(ids, compress=True)[0], 2)
    assert len(calls) == 2 * 2
    for q, resident, memory, chosen, scaling, recall in calls:
        bs = memory.keys.shape[2]
        keys = torch.cat([resident, memory.keys.transpose(0, 1).flatten(1, 2)], dim=1)  # exact: post-RoPE
        probs = torch.softmax(torch.einsum("hgd,hnd->hgn", q, keys) * scaling, -1)[..., resident.shape[1]:]
        rows = [b * bs + i for b in chosen for i in range(bs)]
        expected = (probs[..., rows].sum(-1) / probs.topk(len(rows), dim=-1).values.sum(-1)).mean()
        assert len(chosen) == 3 and recall == pytest.approx(float(expected), rel=1e-5) and recall < 1


def test_the_record_says_whether_the_needles_block_was_retrieved(tiny_llama):
    """A task that knows where its answer lies (RULER's answer offset, the NIAH needle) gives its prompt positions
    to the session; InfLLM's records then say how much of it sat in the block memory and how much of that the
    retrieved blocks held."""
    from kvbench.engine.prompt import PromptBuilder

    sample = kv_turns(1)
    answer = sample.turns[0].answers[0]
    sample.meta["answer_char_offset"] = sample.context.index(answer)
    builder = PromptBuilder(tiny_llama.tokenizer)
    start, end = builder.evidence_positions(sample)
    ctx_ids, _ = builder.first_turn(sample)
    assert tiny_llama.tokenizer.decode(ctx_ids[start:end]).strip() == answer
    record = run_sample(tiny_llama, build_method("infllm", **{**SMALL, "topk": 1}), 64, sample, EngineConfig(nll=False))
    stats = record["decode_method_stats"]
    assert stats["needle_in_memory"] == 1.0  # the answer is far from the end: in a memory block
    assert 0 <= stats["needle_retrieved"] <= stats["needle_in_memory"]
    covering = build_method("infllm", **{**SMALL, "topk": 50})  # every block retrieved
    assert run_sample(tiny_llama, covering, 64, sample, EngineConfig(nll=False))["decode_method_stats"][
        "needle_retrieved"] == 1.0
    assert "needle_in_memory" not in run_sample(tiny_llama, build_method("infllm", **SMALL), 64, kv_turns(1),
                                                EngineConfig(nll=False))["decode_method_stats"]


def test_a_fixed_configuration_is_not_split_by_the_budget():
    omnikv = {"n_init": 128, "n_local": 1024, "topk": 16, "memory_block_size": 32, "max_cached_blocks": 16}
    for budget in (300, 900, 5000):
        d = build_method("infllm", **omnikv).plan(budget, sequence_length=20_000, new_tokens=0, head_dim=128).derived
        assert {k: d[k] for k in ("n_init", "n_local", "topk", "block_size", "cached_blocks", "split")} == \
            {"n_init": 128, "n_local": 1024, "topk": 16, "block_size": 32, "cached_blocks": 16, "split": "fixed"}
    assert build_method("infllm").plan(300, sequence_length=20_000, new_tokens=0, head_dim=128).derived["split"] == \
        "budget"


@pytest.mark.parametrize("preset", ["omnikv_table1", "omnikv_table1_cpu"])
def test_omnikv_presets_run_infllm_in_its_authors_configuration(preset):
    """OmniKV's Table 1 InfLLM: antgroup/OmniKV baselines/infllm/config/llama3-8b-inf-30-longbench.yaml."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        swept = compose("config", overrides=[f"experiment={preset}"], return_hydra_config=True)
        methods = str(swept.hydra.sweeper.params.method).split(",")
        assert "infllm_omnikv" in methods and "infllm" not in methods
        cfg = compose("config", overrides=[f"experiment={preset}", "method=infllm_omnikv"])
    params = {k: v for k, v in OmegaConf.to_container(cfg.method, resolve=True).items() if k != "name"}
    assert {k: params[k] for k in ("memory_block_size", "n_init", "n_local", "topk", "max_cached_blocks", "repr_topk",
                                   "prefill", "prefill_chunk")} == \
        {"memory_block_size": 32, "n_init": 128, "n_local": 1024, "topk": 16, "max_cached_blocks": 16, "repr_topk": 4,
         "prefill": "chunked", "prefill_chunk": 512}
    assert build_method(cfg.method.name, **params).plan(int(0.3 * 9418), sequence_length=9418 + 64, new_tokens=64,
                                                         head_dim=128).derived["split"] == "fixed"
