"""CTKVR and OmniKV: retrieval over an index, cross-layer selection, host placement (tiny random models)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from conftest import model_cfg, random_ids
from reference import reference_chunks

from kvbench.attention.hooks import evict_layer
from kvbench.core.errors import KVBenchError
from kvbench.engine.config import EngineConfig
from kvbench.engine.sample import run_sample
from kvbench.engine.session import Session
from kvbench.kernels.sparse_attention import merge_attention, topk_attention
from kvbench.methods import build_method
from kvbench.methods.ctkvr import build_index
from kvbench.models import load_model
from kvbench.tasks.base import Sample, Turn

PROMPT = 400
SMALL_CTKVR = {"n_init": 8, "n_local": 48, "max_centroids": 64}


def decode(session: Session, logits: torch.Tensor, steps: int) -> list[torch.Tensor]:
    outs = [logits]
    for _ in range(steps):
        outs.append(session.step(int(outs[-1].argmax())))
    return outs


def dense(lm, ids, steps):
    session = Session(lm, build_method("full"), None)
    return decode(session, session.prefill(ids, compress=True)[0], steps)


@pytest.mark.parametrize("name,params", [("ctkvr", SMALL_CTKVR), ("omnikv", {"filter_layers": [1]})])
def test_budget_at_or_above_the_sequence_is_bitwise_full(tiny, name, params):
    ids = random_ids(PROMPT, seed=60)
    session = Session(tiny, build_method(name, **params), PROMPT + 10, sequence_length=PROMPT + 10)
    outs = decode(session, session.prefill(ids, compress=True)[0], 6)
    assert all(torch.equal(a, b) for a, b in zip(outs, dense(tiny, ids, 6)))


def test_ctkvr_retrieving_everything_equals_full_attention(tiny):
    """C' = C and rho' covering every host row: the LSE merge of resident and host attention is attention over
    their union, i.e. full attention (up to summation order)."""
    ids = random_ids(PROMPT, seed=61)
    method = build_method("ctkvr", **SMALL_CTKVR, retrieved_centroids=64, list_ratio=1.0)
    session = Session(tiny, method, PROMPT - 8 - 48, sequence_length=PROMPT + 50)  # rho' = every host row
    outs = decode(session, session.prefill(ids, compress=True)[0], 6)
    assert session.cache.layers[0].derived["host"].keys.shape[1] == PROMPT - 8 - 48
    for ours, theirs in zip(outs, dense(tiny, ids, 6)):
        torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-5)


def test_ctkvr_rerank_is_a_subset_of_the_recall_of_size_rho_prime_and_dcu_replaces_the_oldest(tiny_llama):
    method = build_method("ctkvr", **SMALL_CTKVR)
    seen = []
    recall = method._recall

    def spy(q, index, retrieved):
        rows, valid = recall(q, index, retrieved)
        seen.append((rows.clone(), valid.clone()))
        return rows, valid

    method._recall = spy
    select = method.select
    chosen = []

    def spy_select(layer, q, view, step, scaling):
        sel = select(layer, q, view, step, scaling)
        ext_k, _, ext_valid = sel.external
        host = layer.derived["host"]
        rows = [int((host.keys[h] == ext_k[h, j]).all(-1).nonzero()[0]) for h in range(ext_k.shape[0])
                for j in range(ext_k.shape[1]) if ext_valid[h, j]]
        chosen.append((layer.layer_idx, q.clone(), rows, ext_k.shape[1]))
        return sel

    method.select = spy_select
    budget = 16
    session = Session(tiny_llama, method, budget, sequence_length=PROMPT + 20)
    logits, _ = session.prefill(random_ids(PROMPT, seed=62), compress=True)
    index0 = session.cache.layers[0].derived["index"]
    before = index0.centroids.clone()
    outs = decode(session, logits, 3)
    for (rows, valid), (_, _, picked, width) in zip(seen, chosen):
        recalled = {int(r) for h in range(rows.shape[0]) for r in rows[h][valid[h]]}
        assert set(picked) <= recalled  # rerank picks only recalled rows
        assert width == min(budget, int(valid.sum(dim=1).max()))  # rho' (or the recall size when smaller)
    # DCU: decode query i sits in slot i (the oldest centroids go first); the others are untouched
    index = session.cache.layers[0].derived["index"]
    layer0_queries = [q for idx, q, _, _ in chosen if idx == 0]
    for i, q in enumerate(layer0_queries):
        assert torch.equal(index.centroids[:, i], q.reshape(-1, q.shape[-1]))
    assert torch.equal(index.centroids[:, 3:], before[:, 3:]) and index.pointer == 3
    assert torch.isfinite(outs[-1]).all()


def test_ctkvr_index_built_in_chunks_equals_one_shot_and_points_only_at_host_rows():
    gen = torch.Generator().manual_seed(0)
    heads, group, n, dim, c = 2, 3, 90, 8, 17
    keys = torch.randn(heads, n, dim, generator=gen)
    positions = torch.arange(n).expand(heads, n)
    centroids = torch.randn(heads * group, c, dim, generator=gen)
    centroid_positions = torch.arange(n - c, n)
    host = (positions >= 5) & (positions < n - 20)
    one_shot = build_index(centroids, centroid_positions, keys, positions, host, 12, 0.3, chunk=c)
    chunked = build_index(centroids, centroid_positions, keys, positions, host, 12, 0.3, chunk=4)
    assert torch.equal(one_shot.sort(-1).values, chunked.sort(-1).values)
    assert int(one_shot.min()) >= 0 and int(one_shot.max()) < int(host[0].sum())  # host rows only
    # the score: each head's own causal softmax, then the max over the group (not the max of raw logits)
    logits = torch.einsum("hgcd,hnd->hgcn", centroids.view(heads, group, c, dim), keys) * 0.3
    logits = logits.masked_fill(positions[:, None, None, :] > centroid_positions[None, None, :, None], float("-inf"))
    probs = torch.softmax(logits, -1).amax(1).masked_fill(~host[:, None, :], float("-inf"))
    expected = probs.topk(12, -1).indices - 5
    assert torch.equal(one_shot.sort(-1).values, expected.sort(-1).values)


def test_lse_merge_of_disjoint_partial_attentions_equals_attention_over_their_union():
    gen = torch.Generator().manual_seed(1)
    q, keys, values = torch.randn(2, 4, 16, generator=gen), torch.randn(2, 50, 16, generator=gen), torch.randn(2, 50, 16, generator=gen)
    first, second = torch.arange(0, 20).expand(2, 4, 20), torch.arange(20, 50).expand(2, 4, 30)
    out_a, lse_a = topk_attention(q, keys, values, first, 0.25, return_lse=True)
    out_b, lse_b = topk_attention(q, keys, values, second, 0.25, return_lse=True)
    merged, lse = merge_attention(out_a, lse_a, out_b, lse_b)
    whole, whole_lse = topk_attention(q, keys, values, torch.arange(50).expand(2, 4, 50), 0.25, return_lse=True)
    torch.testing.assert_close(merged, whole, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lse, whole_lse, atol=1e-6, rtol=1e-5)


def test_ctkvr_moves_the_middle_off_the_device_storage_without_a_second_copy(tiny_llama):
    session = Session(tiny_llama, build_method("ctkvr", **SMALL_CTKVR), 16, sequence_length=PROMPT + 20)
    session.query_window = 64
    session.prefill(random_ids(PROMPT, seed=63), compress=False)  # dense, then the event by hand
    full_bytes = session.cache.kv_bytes()
    dense_keys = [weakref.ref(layer.buffers["keys"]) for layer in session.cache.layers]
    step = session.step_context(evict=True)
    for layer in session.cache.layers:
        evict_layer(layer, step)
    gc.collect()
    assert all(ref() is None for ref in dense_keys), "the dense storage must be freed"
    for layer in session.cache.layers:
        host = layer.derived["host"]
        assert layer.lengths() == [8 + 48] * layer.num_heads
        assert host.keys.shape[1] == PROMPT - 8 - 48
        positions = set(layer.positions[0].tolist())
        assert positions == set(range(8)) | set(range(PROMPT - 48, PROMPT))
        assert set(host.positions[0].tolist()).isdisjoint(positions)
    host_kv = sum(2 * layer.derived["host"].keys.numel() * 4 for layer in session.cache.layers)
    assert session.cache.kv_bytes() + host_kv == full_bytes  # one copy of every token, wherever it lives


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_ctkvr_host_rows_are_in_pinned_host_memory_on_cuda():
    lm = load_model(model_cfg("tiny_llama", device="cuda"))
    session = Session(lm, build_method("ctkvr", **SMALL_CTKVR), 16, sequence_length=PROMPT + 20)
    session.prefill(random_ids(PROMPT, seed=64), compress=True)
    for layer in session.cache.layers:
        host = layer.derived["host"]
        assert host.keys.device.type == "cpu" and host.keys.is_pinned() and layer.keys.device.type == "cuda"
    assert torch.isfinite(session.step(5)).all()


def test_omnikv_sparse_layers_attend_exactly_to_the_filter_layers_choice(tiny_llama_deep):
    method = build_method("omnikv", filter_layers=[1, 3], wait_layers=1)
    assert [method.role(i) for i in range(6)] == ["dense", "filter", "wait", "filter", "wait", "sparse"]
    choices = []
    select = method.select

    def spy(layer, q, view, step, scaling):
        out = select(layer, q, view, step, scaling)
        if method.role(layer.layer_idx) == "filter":
            choices[-1][layer.layer_idx] = step.shared["omnikv_selected"].clone()
        return out

    method.select = spy
    ids = random_ids(PROMPT, seed=65)
    session = Session(tiny_llama_deep, method, 24, sequence_length=PROMPT + 24)
    logits, _ = session.prefill(ids, compress=True)
    chunks, past, outs = [ids], [None], [logits]
    for _ in range(4):
        token = int(outs[-1].argmax())
        choices.append({})
        before = session.position
        outs.append(session.step(token))
        chunks.append([token])
        # layer 5 (sparse) sees the tokens layer 3 (the last filter layer) chose, plus every generated token
        mask = torch.zeros(2, before + 1, dtype=torch.bool)
        mask[:, choices[-1][3]] = True
        mask[:, PROMPT:] = True
        past.append({5: mask})
        assert len(choices[-1][1]) == 24 and not torch.equal(choices[-1][1], choices[-1][3])
    for ours, theirs in zip(outs, reference_chunks(tiny_llama_deep.model, chunks, past)):
        torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-5)


def test_omnikv_offload_equals_no_offload_bit_for_bit_and_keeps_the_bank_on_the_host(tiny_llama_deep):
    ids = random_ids(PROMPT, seed=66)
    results = {}
    for offload in (False, True):
        session = Session(tiny_llama_deep, build_method("omnikv", filter_layers=[1, 3], offload=offload), 24,
                          sequence_length=PROMPT + 30)
        results[offload] = (session, decode(session, session.prefill(ids, compress=True)[0], 8))
    (plain, outs_plain), (banked, outs_banked) = results[False], results[True]
    assert all(torch.equal(a, b) for a, b in zip(outs_plain, outs_banked))
    sparse = banked.cache.layers[5]
    assert sparse.derived["bank"].keys.shape[1] == PROMPT and sparse.lengths() == [8, 8]  # the generated tail only
    assert banked.cache.kv_bytes() < plain.cache.kv_bytes()


def kv_turns(turns: int = 2) -> Sample:
    pairs = {f"key-{i:03d}": f"value-{i * 7919 % 1000:03d}" for i in range(40)}
    context = "Remember this table.\n" + "\n".join(f"{k} = {v}" for k, v in pairs.items()) + "\n"
    keys = ["key-005", "key-031", "key-017"][:turns]
    return Sample(id="kv-0", task="synthetic_kv", context=context,
                  turns=[Turn(f"What is {k}?", [pairs[k]], max_new_tokens=6, metric="string_match_all",
                              answer_prefix="Answer:") for k in keys], meta={"mode": "multi_turn"})


@pytest.mark.parametrize("turn_index", ["dcu", "rebuild"])
def test_ctkvr_multi_turn_sends_new_turns_through_the_index(tiny_llama, turn_index):
    method = build_method("ctkvr", **SMALL_CTKVR, turn_index=turn_index)
    record = run_sample(tiny_llama, method, 32, kv_turns(2), EngineConfig(nll=False))
    assert len(record["turns"]) == 2 and record["topk_recall"] is not None
    stats = record["decode_method_stats"]
    assert stats["recall_size"] > 0 and 0 < stats["alpha"] <= 1
    assert record["host_bytes_end"] > 0 and record["device_bytes_end"] > 0
    # both keep every token somewhere: the Table 1 storage is the whole sequence (plus the index is not K/V)
    assert record["storage_ratio_table1"] > 0.9


def test_omnikv_runs_multi_turn_and_question_agnostic(tiny_llama_deep):
    method = build_method("omnikv", filter_layers=[1, 3], offload=True)
    record = run_sample(tiny_llama_deep, method, 32, kv_turns(2), EngineConfig(nll=False))
    assert len(record["turns"]) == 2 and record["topk_recall"] is not None
    agnostic = run_sample(tiny_llama_deep, build_method("omnikv", filter_layers=[1, 3]), 32, kv_turns(1),
                          EngineConfig(compress_question=False))
    assert agnostic["nll"] is not None and agnostic["decode_read_tokens_per_group"] > 0


def test_ctkvr_with_every_centroid_and_full_lists_chooses_what_flat_chooses_and_the_index_costs_4_bytes(tiny_llama):
    """CTKVR §3.1 (Algorithm 2) in the limit: recalling every centroid with lists over every host row, the rerank picks FLAT's exact
    top-rho' (max over the group of each head's softmax over those rows); the qcIVF is b*g*C*rho*4 bytes."""
    budget = 12
    method = build_method("ctkvr", **SMALL_CTKVR, retrieved_centroids=64, list_ratio=100.0)
    session = Session(tiny_llama, method, budget, sequence_length=PROMPT + 10)
    session.prefill(random_ids(PROMPT, seed=67), compress=True)
    layer = session.cache.layers[1]
    index, host = layer.derived["index"], layer.derived["host"]
    centroids, rho = index.centroids.shape[1], index.lists.shape[2]
    assert rho == host.keys.shape[1] and index.lists.dtype == torch.int32
    assert index.lists.numel() * index.lists.element_size() == layer.num_heads * centroids * rho * 4
    q = torch.randn(layer.num_heads, 2, layer.head_dim)
    with torch.inference_mode():  # as inside a forward pass: DCU updates the index in place
        selection = method.select(layer, q, layer.head_view(), session.step_context(), layer.scaling)
    probs = torch.softmax(torch.einsum("hgd,hmd->hgm", q, host.keys) * layer.scaling, -1).amax(1)
    flat = probs.topk(budget, -1).indices
    chosen = selection.external[0]
    expected = host.keys.gather(1, flat[..., None].expand(-1, -1, layer.head_dim))
    assert torch.equal(chosen.sort(1).values, expected.sort(1).values)


@pytest.mark.parametrize("compress_question,turns", [(False, 1), (True, 2)])
def test_omnikv_offload_equals_no_offload_with_a_question_or_a_turn_appended(tiny_llama_deep, compress_question, turns):
    """A chunk appended after the prompt attends densely to the whole prompt, the Context Bank's rows too."""
    records = [run_sample(tiny_llama_deep, build_method("omnikv", filter_layers=[1, 3], offload=offload), 32,
                          kv_turns(turns), EngineConfig(compress_question=compress_question))
               for offload in (False, True)]
    for a, b in zip(*(r["turns"] for r in records)):
        assert a["prediction"] == b["prediction"] and a["nll"] == b["nll"]
    assert records[1]["host_bytes_end"] > 0 and records[0]["host_bytes_end"] == 0


def test_omnikv_prefill_sparse_layers_attend_to_the_filter_layers_chunk_choice_plus_the_chunk(tiny_llama_deep):
    """OmniKV-prefill (App. D.10): in every chunk after the first, the filter layer keeps r x chunk past tokens
    (the uniform selector over the chunk's queries) and the sparse layer after it attends causally to exactly
    those plus the chunk; the logits match a dense reference with that visibility. Nothing is dropped."""
    chunk, ratio = 96, 0.25
    method = build_method("omnikv", filter_layers=[1, 3], prefill_chunk=chunk, prefill_ratio=ratio)
    choices = []
    context = method.chunk_context

    def spy(layer, query, step, scaling):
        out = context(layer, query, step, scaling)
        if layer.layer_idx == 3:
            choices.append(step.shared["omnikv_prefill_selected"].clone())
        return out

    method.chunk_context = spy
    ids = random_ids(PROMPT, seed=68)
    session = Session(tiny_llama_deep, method, 24, sequence_length=PROMPT + 24)
    logits, _ = session.prefill(ids, compress=True)
    chunks = [ids[i:i + chunk] for i in range(0, PROMPT, chunk)]
    assert len(choices) == len(chunks) - 1
    past = [None]
    for c, chosen in enumerate(choices, start=1):
        start = c * chunk
        assert len(chosen) == round(ratio * len(chunks[c])) and int(chosen.max()) < start
        mask = torch.zeros(2, start, dtype=torch.bool)
        mask[:, chosen] = True
        past.append({5: mask})
    torch.testing.assert_close(logits, reference_chunks(tiny_llama_deep.model, chunks, past)[-1], atol=2e-5, rtol=1e-5)
    assert all(layer.lengths() == [PROMPT, PROMPT] for layer in session.cache.layers)  # nothing dropped
    assert torch.isfinite(session.step(int(logits.argmax()))).all()


def test_omnikv_prefill_with_every_past_token_kept_is_the_chunked_dense_prefill_and_offload_changes_nothing(
        tiny_llama_deep):
    ids = random_ids(PROMPT, seed=69)
    outs = {}
    for name, params in {"dense": {}, "all": {"prefill_chunk": 128, "prefill_ratio": 100.0},
                         "plain": {"prefill_chunk": 128}, "banked": {"prefill_chunk": 128, "offload": True}}.items():
        session = Session(tiny_llama_deep, build_method("omnikv", filter_layers=[1, 3], **params), 24,
                          sequence_length=PROMPT + 24)
        outs[name] = decode(session, session.prefill(ids, compress=True)[0], 4)
    for a, b in zip(outs["all"], outs["dense"]):  # chunked vs one-pass dense prefill: the same up to summation order
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(outs["plain"], outs["banked"]))
    assert not torch.equal(outs["plain"][0], outs["all"][0])  # r = 2 at chunk 128 keeps 256 of 384: it changes something


@pytest.mark.parametrize("selector", ["uniform", "exp"])
def test_omnikv_window_selectors_keep_the_windows_prompt_tokens_and_k_tokens_in_all(tiny_llama_deep, selector):
    method = build_method("omnikv", filter_layers=[1, 3], selector=selector, window=4)
    chosen = []
    select = method.select

    def spy(layer, q, view, step, scaling):
        out = select(layer, q, view, step, scaling)
        if layer.layer_idx == 1:
            chosen.append((layer.seen, step.shared["omnikv_selected"].clone()))
        return out

    method.select = spy
    session = Session(tiny_llama_deep, method, 24, sequence_length=PROMPT + 24)
    decode(session, session.prefill(random_ids(PROMPT, seed=70), compress=True)[0], 4)
    for seen, picked in chosen:
        window_prompt = [p for p in range(seen - 4, seen) if p < PROMPT]
        assert len(picked) == 24 and set(window_prompt) <= set(picked.tolist())
        assert torch.equal(picked, picked.sort().values)


def test_omnikv_uniform_selector_over_one_query_is_the_softmax_last_selector(tiny_llama_deep):
    ids = random_ids(PROMPT, seed=71)
    outs = []
    for params in ({"selector": "uniform", "window": 1}, {"score_space": "softmax"}):
        session = Session(tiny_llama_deep, build_method("omnikv", filter_layers=[1, 3], **params), 24,
                          sequence_length=PROMPT + 24)
        outs.append(decode(session, session.prefill(ids, compress=True)[0], 4))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_omnikv_exp_selector_halves_each_older_querys_weight():
    from kvbench.methods.omnikv import _window_score

    keys = torch.eye(4)[None]  # one KV head, 4 keys; queries pick one key each, sharply
    queries = 50 * torch.eye(4)[None, :3]  # window of 3 queries: keys 0, 1, 2
    score = _window_score(queries, keys, 1, 1.0, "exp")
    torch.testing.assert_close(score[:3], torch.tensor([0.25, 0.5, 1.0]), atol=1e-6, rtol=0)
    torch.testing.assert_close(_window_score(queries, keys, 1, 1.0, "uniform")[:3], torch.ones(3), atol=1e-6, rtol=0)


def _ctkvr_index_and_prompt_queries(lm, rule, seed=0):
    """A CTKVR session over a 400-token prompt with `centroid_positions=rule`: its layers, the queries each layer
    attended the prompt with (as the method observed them), and the rows it drew."""
    method = build_method("ctkvr", **SMALL_CTKVR, centroid_positions=rule)
    seen = {}
    observe = method.observe

    def spy(layer, queries, step):
        seen[layer.layer_idx] = queries.clone()
        observe(layer, queries, step)

    method.observe = spy
    session = Session(lm, method, 32, sequence_length=PROMPT + 10, generator=torch.Generator().manual_seed(seed))
    session.prefill(random_ids(PROMPT, seed=68), compress=True)
    drawn = session.shared.get("ctkvr_centroid_rows")
    return session.cache.layers, seen, None if drawn is None else drawn[1]


@pytest.mark.parametrize("rule", ["init", "equi", "random"])
def test_ctkvr_centroid_positions_take_the_rule_s_prompt_queries_in_every_layer(tiny_llama, rule):
    """CTKVR Table 4: INIT the first C prompt queries, EQUI C evenly spaced from the first to the last, RANDOM C
    distinct positions drawn once from the sample's generator; the same positions in every layer, indexed
    causally, the pool freed once the index is built, and the lists still point into the host rows only (M4)."""
    layers, queries, rows = _ctkvr_index_and_prompt_queries(tiny_llama, rule)
    count = min(SMALL_CTKVR["max_centroids"], PROMPT // 16)
    expected = {"init": torch.arange(count),
                "equi": torch.tensor([round(i * (PROMPT - 1) / (count - 1)) for i in range(count)])}.get(rule)
    assert rows.shape == (count,) and torch.equal(rows, rows.unique())  # ascending, distinct
    if expected is not None:
        assert torch.equal(rows, expected)
    else:
        assert int(rows[-1]) < PROMPT and not torch.equal(rows, torch.arange(PROMPT - count, PROMPT))
    assert len(queries) == len(layers)
    for layer in layers:
        index, host = layer.derived["index"], layer.derived["host"]
        assert "centroid_pool" not in layer.derived
        assert torch.equal(index.centroids, queries[layer.layer_idx][:, rows])
        assert int(index.lists.min()) >= 0 and int(index.lists.max()) < host.keys.shape[1]
    again = _ctkvr_index_and_prompt_queries(tiny_llama, rule)[2]
    other = _ctkvr_index_and_prompt_queries(tiny_llama, rule, seed=1)[2]
    assert torch.equal(again, rows) and torch.equal(other, rows) == (rule != "random")


def test_ctkvr_final_centroid_positions_are_the_default_index(tiny_llama):
    default, _, _ = _ctkvr_index_and_prompt_queries(tiny_llama, None)
    final, observed, _ = _ctkvr_index_and_prompt_queries(tiny_llama, "final")
    assert not observed  # the last C queries come from the layer's query window, as by default
    for ours, theirs in zip(final, default):
        assert torch.equal(ours.derived["index"].centroids, theirs.derived["index"].centroids)
        assert torch.equal(ours.derived["index"].lists, theirs.derived["index"].lists)


def test_ctkvr_centroid_positions_reject_unknown_rules_and_rebuilt_turns():
    with pytest.raises(KVBenchError, match="centroid_positions must be one of final, init, equi, random"):
        build_method("ctkvr", centroid_positions="middle")
    with pytest.raises(KVBenchError, match="need turn_index=dcu"):
        build_method("ctkvr", centroid_positions="equi", turn_index="rebuild")


@pytest.mark.parametrize("dcu", [None, False])
def test_ctkvr_without_dcu_keeps_the_prompt_s_index_through_decode_and_new_turns(tiny_llama, dcu):
    """CTKVR Table 5's ablation: `dcu: false` decodes (and steps a new turn's tokens) over the index the prompt
    built; by default every step's query replaces the oldest centroid."""
    method = build_method("ctkvr", **SMALL_CTKVR, dcu=dcu)
    session = Session(tiny_llama, method, 32, sequence_length=PROMPT + 10)
    logits, _ = session.prefill(random_ids(PROMPT, seed=69), compress=True)
    built = [(layer.derived["index"].centroids.clone(), layer.derived["index"].lists.clone())
             for layer in session.cache.layers]
    decode(session, logits, 3)
    session.prefill(random_ids(5, seed=70), compress=False)  # a new turn: token by token through the index
    for layer, (centroids, lists) in zip(session.cache.layers, built):
        index = layer.derived["index"]
        if dcu is False:
            assert index.pointer == 0 and torch.equal(index.centroids, centroids) and torch.equal(index.lists, lists)
        else:
            assert index.pointer == 3 + 5 and not torch.equal(index.centroids, centroids)
            assert torch.equal(index.centroids[:, 8:], centroids[:, 8:])  # the oldest eight were replaced
