"""RetrievalAttention: host placement, the graph index (faiss HNSW, RoarGraph's projected edges), decode over
resident + retrieved rows (tiny random models); and scripts/bench_index_build.py's functions on random data."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import random_ids
from reference import reference_chunks

from kvbench.engine.config import EngineConfig
from kvbench.engine.sample import run_sample
from kvbench.engine.session import Session
from kvbench.methods import build_method
from kvbench.methods.retrieval_attention import build_graph
from kvbench.tasks.base import Sample, Turn

PROMPT = 400
SMALL = {"n_init": 8, "n_local": 48, "index_queries": 64}
HOST_ROWS = PROMPT - 8 - 48


def decode(session: Session, logits: torch.Tensor, steps: int) -> list[torch.Tensor]:
    outs = [logits]
    for _ in range(steps):
        outs.append(session.step(int(outs[-1].argmax())))
    return outs


def dense(lm, ids, steps):
    session = Session(lm, build_method("full"), None)
    return decode(session, session.prefill(ids, compress=True)[0], steps)


@pytest.mark.parametrize("graph", ["roar", "hnsw"])
def test_graph_search_with_a_wide_beam_returns_the_exact_top_k_and_builds_deterministically(graph):
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(300, 16, generator=gen).numpy()
    queries = torch.randn(40, 16, generator=gen).numpy()
    index = build_graph(keys, queries if graph == "roar" else None, m=8, query_knn=16)
    again = build_graph(keys, queries if graph == "roar" else None, m=8, query_knn=16)
    import faiss

    assert np.array_equal(faiss.vector_to_array(index.hnsw.neighbors), faiss.vector_to_array(again.hnsw.neighbors))
    params = faiss.SearchParametersHNSW()
    params.efSearch = 300
    probe = torch.randn(6, 16, generator=gen).numpy()
    _, found = index.search(probe, 20, params=params)
    exact = np.argsort(-(probe @ keys.T), axis=1, kind="stable")[:, :20]
    assert all(set(found[i]) == set(exact[i]) for i in range(len(probe)))  # recall 1


def test_roar_projection_lists_each_pivots_co_retrieved_keys_first():
    """RoarGraph's projection: a key that is some prefill query's nearest key links first to the other keys of
    that query's exact top list (in rank order); the HNSW's own neighbours follow."""
    gen = torch.Generator().manual_seed(1)
    keys = torch.randn(200, 8, generator=gen)
    queries = torch.randn(1, 8, generator=gen)
    index = build_graph(keys.numpy(), queries.numpy(), m=8, query_knn=6)
    import faiss

    top = (queries @ keys.T).topk(6).indices[0].tolist()
    offsets = faiss.vector_to_array(index.hnsw.offsets)
    neighbors = faiss.vector_to_array(index.hnsw.neighbors)
    pivot = top[0]
    assert neighbors[offsets[pivot]:offsets[pivot] + 5].tolist() == top[1:]
    plain = build_graph(keys.numpy(), None, m=8)
    assert not np.array_equal(neighbors, faiss.vector_to_array(plain.hnsw.neighbors))


@pytest.mark.parametrize("graph", ["roar", "hnsw"])
def test_budget_at_or_above_the_sequence_is_bitwise_full(tiny, graph):
    ids = random_ids(PROMPT, seed=70)
    method = build_method("retrieval_attention", **SMALL, graph=graph)
    session = Session(tiny, method, PROMPT + 10, sequence_length=PROMPT + 10)
    outs = decode(session, session.prefill(ids, compress=True)[0], 6)
    assert all(torch.equal(a, b) for a, b in zip(outs, dense(tiny, ids, 6)))
    assert not any(layer.derived for layer in session.cache.layers)


@pytest.mark.parametrize("granularity", ["head", "group_max"])
def test_a_budget_covering_every_host_row_is_full_attention(tiny, granularity):
    """k = every host row: the log-sum-exp merge of resident and host attention is attention over their union."""
    ids = random_ids(PROMPT, seed=71)
    method = build_method("retrieval_attention", **SMALL, granularity=granularity)
    session = Session(tiny, method, HOST_ROWS, sequence_length=PROMPT + 50)
    outs = decode(session, session.prefill(ids, compress=True)[0], 6)
    for ours, theirs in zip(outs, dense(tiny, ids, 6)):
        torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-5)


def test_prefill_moves_the_middle_to_host_memory_and_indexes_exactly_those_rows(tiny_llama):
    session = Session(tiny_llama, build_method("retrieval_attention", **SMALL), 16, sequence_length=PROMPT + 20)
    dense_session = Session(tiny_llama, build_method("full"), None)
    dense_session.prefill(random_ids(PROMPT, seed=72), compress=True)
    session.prefill(random_ids(PROMPT, seed=72), compress=True)
    host_kv = 0
    for layer in session.cache.layers:
        host, index = layer.derived["host"], layer.derived["index"]
        resident = set(layer.positions[0].tolist())
        assert layer.lengths() == [8 + 48] * layer.num_heads
        assert resident == set(range(8)) | set(range(PROMPT - 48, PROMPT))
        assert set(host.positions[0].tolist()) == set(range(8, PROMPT - 48))
        assert index.rows == host.keys.shape[1] == HOST_ROWS
        assert all(graph.ntotal == HOST_ROWS for graph in index.graphs) and len(index.graphs) == layer.num_heads
        assert index.nbytes() > 0 and index.paper_elements > 0
        host_kv += 2 * host.keys.numel() * host.keys.element_size()
    assert session.cache.kv_bytes() + host_kv == dense_session.cache.kv_bytes()  # one copy of every token


@pytest.mark.parametrize("granularity", ["head", "group_max"])
def test_decode_logits_equal_attention_over_the_resident_set_and_each_heads_retrieved_rows(tiny_llama, granularity):
    """Each decode step equals a dense eager run in which every query head sees the resident tokens and exactly
    the host rows retrieved for it (its own search's top-k, or the group's reranked top-k)."""
    method = build_method("retrieval_attention", **SMALL, granularity=granularity)
    retrieve, chosen = method._retrieve, []

    def spy(q, host, index, step, scaling):
        rows, valid, own, extra = retrieve(q, host, index, step, scaling)
        layer = next(layer for layer in step.cache.layers if layer.derived.get("host") is host)
        heads, group = own.shape[:2]
        mask = torch.zeros(heads * group, layer.seen, dtype=torch.bool)
        for h in range(heads):
            mask[h * group:(h + 1) * group, layer.positions[h].long()] = True
            for g in range(group):
                mask[h * group + g, host.positions[h, rows[h][own[h, g] & valid[h]]].long()] = True
        assert int(own[0, 0].sum()) == 16  # k = the budget per query head
        chosen[-1][layer.layer_idx] = mask
        return rows, valid, own, extra

    method._retrieve = spy
    ids = random_ids(PROMPT, seed=73)
    session = Session(tiny_llama, method, 16, sequence_length=PROMPT + 20)
    logits, _ = session.prefill(ids, compress=True)
    chunks, past, outs = [ids], [None], [logits]
    for _ in range(4):
        token = int(outs[-1].argmax())
        chosen.append({})
        outs.append(session.step(token))
        chunks.append([token])
        past.append(chosen[-1])
    assert all(len(step) == 2 for step in chosen)
    for ours, theirs in zip(outs, reference_chunks(tiny_llama.model, chunks, past)):
        torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-5)


def test_dense_layers_keep_their_cache_and_build_no_index(tiny_llama):
    session = Session(tiny_llama, build_method("retrieval_attention", **SMALL, dense_layers=1), 16,
                      sequence_length=PROMPT + 20)
    outs = decode(session, session.prefill(random_ids(PROMPT, seed=75), compress=True)[0], 3)
    dense_layer, retrieving = session.cache.layers
    assert dense_layer.lengths() == [PROMPT + 3] * 2 and not dense_layer.derived
    assert retrieving.lengths() == [8 + 48 + 3] * 2 and retrieving.derived["index"].rows == HOST_ROWS
    assert all(torch.isfinite(o).all() for o in outs)


def test_two_runs_are_identical(tiny_qwen3):
    ids = random_ids(PROMPT, seed=74)
    runs = []
    for _ in range(2):
        session = Session(tiny_qwen3, build_method("retrieval_attention", **SMALL), 24, sequence_length=PROMPT + 20)
        session.measure_recall = True
        runs.append((decode(session, session.prefill(ids, compress=True)[0], 5), dict(session.cache.stats.extra_sums)))
    assert all(torch.equal(a, b) for a, b in zip(runs[0][0], runs[1][0])) and runs[0][1] == runs[1][1]


def test_a_sample_records_the_search_traffic_recall_and_host_bytes(tiny_llama):
    pairs = {f"key-{i:03d}": f"value-{i * 7919 % 1000:03d}" for i in range(40)}
    context = "Remember this table.\n" + "\n".join(f"{k} = {v}" for k, v in pairs.items()) + "\n"
    sample = Sample(id="kv-0", task="synthetic_kv", context=context,
                    turns=[Turn("What is key-005?", [pairs["key-005"]], max_new_tokens=6, metric="string_match_all",
                                answer_prefix="Answer:")])
    record = run_sample(tiny_llama, build_method("retrieval_attention", **SMALL), 32, sample, EngineConfig(nll=False))
    stats = record["decode_method_stats"]
    assert stats["visited_keys"] > 0 and stats["retrieved_rows"] >= 32 and 0 <= stats["ann_recall"] <= 1
    assert 0 < record["topk_recall"] <= 1 + 1e-6
    assert record["host_bytes_end"] > 0 and record["device_bytes_end"] > 0
    # reads: the resident K/V, >= 32 retrieved rows and the keys the search scored, per group and step
    assert record["decode_read_tokens_per_group"] > 8 + 48 + 32
    assert record["storage_ratio_table1"] > 0.9  # every token is kept somewhere


def test_records_say_how_many_rows_a_kv_group_reads_per_step_and_which_settings_are_unverified(tiny_llama):
    """`group_max` (conf retrieval_attention_group, ctkvr_table8's): k rows per KV group, CTKVR's count of rho'; `head`
    (the paper's per-head attention): each query head its own k, so a group reads between k and G*k distinct rows.
    Both records say which, and name the settings whose paper values are unverified."""
    sample = Sample(id="kv-1", task="synthetic_kv", context="Remember.\n" + "\n".join(
        f"key-{i:03d} = value-{i * 7919 % 1000:03d}" for i in range(40)), turns=[Turn(
        "What is key-005?", ["value-595"], max_new_tokens=4, metric="string_match_all", answer_prefix="Answer:")])
    group = run_sample(tiny_llama, build_method("retrieval_attention", **SMALL, granularity="group_max"), 32, sample,
                       EngineConfig(nll=False))
    head = run_sample(tiny_llama, build_method("retrieval_attention", **SMALL), 32, sample, EngineConfig(nll=False))
    for record, per_group in ((group, 32), (head, None)):
        plan = record["budget_plan"]
        assert plan["k_per_query_head"] == 32 and plan["k_per_kv_group"] == per_group
        assert plan["unverified"] == ["n_init", "n_local", "ef_search"]
    assert group["budget_plan"]["granularity"] == "group_max" and head["budget_plan"]["granularity"] == "head"
    assert group["decode_method_stats"]["retrieved_rows"] == 32  # exactly k per KV group and step
    groups = tiny_llama.model.config.num_attention_heads // tiny_llama.model.config.num_key_value_heads
    assert 32 < head["decode_method_stats"]["retrieved_rows"] <= groups * 32


def _bench():
    path = Path(__file__).resolve().parents[1] / "scripts" / "bench_index_build.py"
    spec = importlib.util.spec_from_file_location("bench_index_build", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_index_build", module)  # its dataclass resolves annotations in its module
    spec.loader.exec_module(module)
    return module


def test_index_build_benchmark_runs_every_index_on_random_data():
    bench = _bench()
    data = bench.gaussian_data(n=2048, heads=2, group=2, dim=16, test_queries=4, seed=0)
    rows = bench.measure(data, k=64, centroids=128, seed=0, kmeans_iters=20)
    assert {row["method"] for row in rows} == {"ctkvr", "ivf", "hnsw", "kmeans", "roargraph"}
    for row in rows:
        assert row["build_ms"] > 0 and 0 <= row["recall"] <= 1 and row["scored_keys"] > 0
    ctkvr = next(row for row in rows if row["method"] == "ctkvr")
    assert ctkvr["build_ratio"] == 1.0
