"""Dynamic sparse attention and RocketKV: Quest, SparQ, HSA, RocketKV, RocketKV-MT on tiny random models."""

from __future__ import annotations

import pytest
import torch
from conftest import random_ids
from reference import kept_masks, reference_chunks

from kvbench.core.contract import Plan, Selection, Step
from kvbench.engine.config import EngineConfig
from kvbench.engine.sample import run_sample
from kvbench.engine.session import Session
from kvbench.kernels.distinct_rows import distinct_rows
from kvbench.kernels.sparse_attention import topk_attention
from kvbench.methods import build_method
from kvbench.methods.common.pages import PageSummary
from kvbench.methods.hsa import hsa_select
from kvbench.methods.rocketkv import rocket_plan
from kvbench.tasks.base import Sample, Turn

SPARSE = ["quest", "sparq", "hsa", "rocketkv", "rocketkv_mt", "exact_topk"]
PROMPT = 300


def decode(session: Session, logits: torch.Tensor, steps: int) -> list[torch.Tensor]:
    outs = [logits]
    for _ in range(steps):
        outs.append(session.step(int(outs[-1].argmax())))
    return outs


@pytest.mark.parametrize(
    "sequence_length,budget,row",
    [(16000, 256, (62.5, 0.558, 1592, 1464, 6.22, 3, 61, 128)), (16000, 4096, (3.9, 0.318, 10374, 10246, 2.53, 2, 101, 2048)),
     (32768, 512, (64, 0.560, 3191, 3063, 6.23, 3, 61, 256)), (32768, 4096, (8, 0.380, 14868, 14740, 3.63, 2, 70, 2048)),
     (65536, 1024, (64, 0.560, 6382, 6254, 6.23, 3, 61, 512)), (100000, 256, (390.6, 0.717, 1389, 1261, 5.43, 3, 70, 128)),
     (100000, 4096, (24.4, 0.477, 21811, 21683, 5.32, 3, 72, 2048))],
)
def test_budget_decomposition_reproduces_the_specs_worked_table(sequence_length, budget, row):
    d = rocket_plan(sequence_length, budget, head_dim=128, new_tokens=128)
    c, r, cap, prompt_budget, c2, page, k1, k2 = row
    assert round(d["c"], 1) == pytest.approx(c, abs=0.05) and round(d["r"], 3) == pytest.approx(r, abs=5e-4)
    assert (d["capacity"], d["prompt_budget"], d["page_size"], d["k1"], d["k2"]) == (cap, prompt_budget, page, k1, k2)
    assert round(d["c2"], 2) == pytest.approx(c2, abs=5e-3)


@pytest.mark.parametrize("name", SPARSE)
def test_budget_at_or_above_the_sequence_is_bitwise_full(tiny, name):
    ids = random_ids(PROMPT, seed=50)
    full = Session(tiny, build_method("full"), None)
    outs_full = decode(full, full.prefill(ids, compress=True)[0], 6)
    session = Session(tiny, build_method(name, last_prompt_token_via_decode=False) if "rocket" in name
                      else build_method(name), PROMPT + 10, sequence_length=PROMPT + 10)
    outs = decode(session, session.prefill(ids, compress=True)[0], 6)
    assert all(torch.equal(a, b) for a, b in zip(outs, outs_full))
    assert session.cache.stats.recall_steps == 0 and session.cache.evictions() == 0


def test_selection_traffic_is_counted_on_the_device_and_read_once(tiny_llama):
    session = Session(tiny_llama, build_method("exact_topk"), 32, sequence_length=PROMPT + 8)
    logits, _ = session.prefill(random_ids(PROMPT, seed=56), compress=True)
    decode(session, logits, 3)
    stats = session.cache.stats
    assert stats.layer_steps == 3 * len(session.cache.layers)
    assert all(isinstance(elements, torch.Tensor) for elements, _, _ in stats._unread)  # no read per step
    counted = stats.read_elements
    assert not stats._unread and stats.read_elements == counted  # read once, then kept as numbers

    layer = session.cache.layers[0]
    idx = torch.randint(0, layer.physical_length(), (layer.num_heads, 3, 40), generator=torch.Generator().manual_seed(0))
    distinct = sum(int(torch.unique(idx[h]).numel()) for h in range(layer.num_heads))  # repeats read once per group
    traffic = session.method.step_traffic(layer, Selection(idx), session.step_context())
    assert int(traffic) == 2 * layer.head_dim * distinct


def test_sparq_shared_selection_traffic_is_the_distinct_count_without_counting(tiny_llama):
    """SparQ's group-shared tokens are distinct (a top-k), so its step traffic counts k rows per KV head, as
    `distinct_rows` over the expanded selection would, plus the r rows of the transposed keys and the mean value."""
    session = Session(tiny_llama, build_method("sparq"), 32, sequence_length=PROMPT + 8)
    logits, _ = session.prefill(random_ids(PROMPT, seed=57), compress=True)
    decode(session, logits, 2)
    layer, step = session.cache.layers[0], session.step_context()
    heads, group, dim = layer.num_heads, tiny_llama.model.config.num_attention_heads // layer.num_heads, layer.head_dim
    q = torch.randn(heads, group, dim, generator=torch.Generator().manual_seed(1))
    selection = session.method.select(layer, q, layer.head_view(), step, dim ** -0.5)
    idx = selection.idx
    assert idx.stride(1) == 0 and idx.shape[-1] == step.plan.derived["k2"]  # one selection shared by the group
    counted = 2 * dim * int(distinct_rows(idx.reshape(heads, -1), layer.physical_length()))
    estimate = heads * step.plan.derived["r"] * int(session.method._state(layer).length)
    assert int(session.method.step_traffic(layer, selection, step)) == estimate + counted + heads * dim


def test_hsa_with_every_dimension_and_unit_pages_is_exact_top_k_and_all_tokens_exact_attention():
    gen = torch.Generator().manual_seed(0)
    heads, group, dim, n = 2, 4, 16, 37
    q, keys, values = torch.randn(heads, group, dim, generator=gen), torch.randn(heads, n, dim, generator=gen), \
        torch.randn(heads, n, dim, generator=gen)
    pages = PageSummary.of(keys, 1)
    # unit pages make the bound exact and k1 = D makes the temperature sqrt(D): the scores are the group-mean
    # attention probabilities, so the selection is the exact group top-k
    idx = hsa_select(q, pages, dim, 9, n)
    probs = torch.softmax(torch.einsum("hgd,hld->hgl", q, keys) / dim**0.5, -1).mean(1)
    assert torch.equal(idx[:, 0].sort(-1).values, probs.topk(9, -1).indices.sort(-1).values)
    assert torch.equal(idx[:, 0], idx[:, -1])  # shared by the group
    every = hsa_select(q, pages, dim, n, n)
    exact = torch.einsum("hgl,hld->hgd", torch.softmax(torch.einsum("hgd,hld->hgl", q, keys) * 0.25, -1), values)
    torch.testing.assert_close(topk_attention(q, keys, values, every, 0.25), exact, atol=1e-6, rtol=1e-5)


def test_sparq_with_every_dimension_and_all_tokens_is_exact_attention(tiny_llama):
    ids = random_ids(PROMPT, seed=51)
    session = Session(tiny_llama, build_method("sparq", reallocation=False), 64, sequence_length=PROMPT + 64)
    session.prefill(ids, compress=True)
    layer = session.cache.layers[1]
    view = layer.head_view()
    q = torch.randn(layer.num_heads, 2, layer.head_dim)
    n = view.keys.shape[1]
    # r = D: the estimate is q.K exactly and the temperature sqrt(D), so with k = every token
    plan = Plan(None, 64, {"r": layer.head_dim, "k2": n - 1})
    idx = session.method.select(layer, q, view, Step(session.cache, session.method, plan), layer.scaling)
    exact_top = torch.softmax(torch.einsum("hgd,hld->hgl", q, view.keys) * layer.scaling, -1).mean(1).topk(n - 1).indices
    assert torch.equal(idx[:, 0].sort(-1).values, exact_top.sort(-1).values)
    every = torch.arange(n).expand(layer.num_heads, 2, n)
    exact = torch.einsum("hgl,hld->hgd", torch.softmax(torch.einsum("hgd,hld->hgl", q, view.keys) * layer.scaling, -1),
                         view.values)
    torch.testing.assert_close(topk_attention(q, view.keys, view.values, every, layer.scaling), exact, atol=1e-6, rtol=1e-5)


def test_sparq_reallocation_blends_the_mean_value_by_the_estimated_mass(tiny_llama):
    session = Session(tiny_llama, build_method("sparq"), 64, sequence_length=PROMPT + 64)
    session.prefill(random_ids(PROMPT, seed=52), compress=True)
    layer = session.cache.layers[0]
    view = layer.head_view()
    q = torch.randn(layer.num_heads, 2, layer.head_dim)
    selection = session.method.select(layer, q, view, session.step_context(), layer.scaling)
    assert selection.weight.shape == (layer.num_heads, 2, 1) and bool(((selection.weight > 0) & (selection.weight < 1)).all())
    torch.testing.assert_close(selection.fallback[:, 0], view.values.mean(1), atol=1e-6, rtol=1e-5)
    assert torch.equal(layer.derived["keys_t"].keys_t, view.keys.transpose(1, 2))  # K stored a second time


@pytest.mark.parametrize("name", ["quest", "hsa", "rocketkv"])
def test_incremental_page_summaries_equal_a_rebuild(tiny, name):
    ids = random_ids(PROMPT, seed=53)
    session = Session(tiny, build_method(name), 48, sequence_length=PROMPT + 100)
    logits, _ = session.prefill(ids, compress=True)

    def check():
        for layer in session.cache.layers:
            pages = layer.derived["pages"]
            rebuilt = PageSummary.of(layer.head_view().keys, pages.page_size)
            assert pages.length == rebuilt.length == layer.physical_length()
            assert torch.equal(pages.kmin, rebuilt.kmin) and torch.equal(pages.kmax, rebuilt.kmax)

    check()  # after prefill (and RocketKV's eviction)
    end_of_prompt = session.position
    decode(session, logits, 100)
    check()  # after 100 appended tokens: only the last page and new ones were recomputed
    session.rollback(end_of_prompt + 37)  # a multi-turn rollback cuts a suffix in the middle of a page
    check()
    session.prefill(random_ids(20, seed=54), compress=False)
    check()


@pytest.mark.parametrize("name,state", [("quest", "pages"), ("sparq", "keys_t")])
def test_derived_state_updates_in_place_and_copies_before_writing_what_a_clone_shares(tiny_llama, name, state):
    method = build_method(name, page_size=8) if name == "quest" else build_method(name)
    session = Session(tiny_llama, method, 48, sequence_length=PROMPT + 100)
    logits, _ = session.prefill(random_ids(PROMPT, seed=54), compress=True)

    def tensor_of(run):  # page bounds / transposed keys: views of the state's growing buffers
        derived = run.cache.layers[0].derived[state]
        return derived.kmin if state == "pages" else derived.keys_t

    def check(run):  # equal to a rebuild from what the layer holds now
        for layer in run.cache.layers:
            got = layer.derived[state]
            if state == "pages":
                rebuilt = PageSummary.of(layer.head_view().keys, 8)
                assert torch.equal(got.kmin, rebuilt.kmin) and torch.equal(got.kmax, rebuilt.kmax)
            else:
                assert torch.equal(got.keys_t, layer.head_view().keys.transpose(1, 2))

    session.cache.reserve(40)  # as decoding does: the derived state makes room for the tokens too
    derived = session.cache.layers[0].derived[state]
    storage = tensor_of(session).data_ptr()
    logits = decode(session, logits, 20)[-1]
    assert session.cache.layers[0].derived[state] is derived and tensor_of(session).data_ptr() == storage  # in place

    twin = session.fork()
    before = tensor_of(session).clone()
    decode(twin, logits, 9)  # the twin's appends go to its own copy
    assert torch.equal(tensor_of(session), before)
    for run in (twin, session):
        decode(run, run.step(int(logits.argmax())), 3)
        check(run)
    assert tensor_of(twin).data_ptr() != tensor_of(session).data_ptr()


def test_quest_page_bound_never_below_the_true_page_maximum(tiny_llama):
    session = Session(tiny_llama, build_method("quest", page_size=5), 64, sequence_length=PROMPT + 64)
    session.prefill(random_ids(PROMPT, seed=55), compress=True)
    from kvbench.kernels.page_summary import page_scores

    for layer in session.cache.layers:
        keys = layer.head_view().keys
        q = torch.randn(layer.num_heads, 2, layer.head_dim)
        pages = layer.derived["pages"]
        dims = torch.arange(layer.head_dim).expand(layer.num_heads, -1)
        bound = page_scores(q, pages.kmin, pages.kmax, dims, q > 0)  # [H, G, P]
        logits = torch.einsum("hgd,hld->hgl", q, keys)
        for p in range(pages.pages):
            true_max = logits[..., p * 5:(p + 1) * 5].amax(-1)
            assert bool((bound[..., p] >= true_max - 1e-5).all())


def kv_sample(turns: int = 2) -> Sample:
    pairs = {f"key-{i:03d}": f"value-{i * 7919 % 1000:03d}" for i in range(60)}
    context = "Remember this table.\n" + "\n".join(f"{k} = {v}" for k, v in pairs.items()) + "\n"
    keys = ["key-005", "key-031", "key-047"][:turns]
    return Sample(id="kv-0", task="synthetic_kv", context=context,
                  turns=[Turn(f"What is {k}?", [pairs[k]], max_new_tokens=8, metric="string_match_all",
                              answer_prefix="Answer:") for k in keys], meta={"mode": "multi_turn"})


def test_rocketkv_mt_selects_from_the_full_history_and_keeps_it_while_rocketkv_stays_at_capacity(tiny_llama):
    sample = kv_sample(3)
    cfg = EngineConfig(nll=False, reuse_prefill=False)  # every compressed prefill goes through Session.prefill
    plain_method, mt_method = build_method("rocketkv"), build_method("rocketkv_mt", window=32)
    selections: list[dict[int, torch.Tensor]] = []
    keep = mt_method.keep

    def spy(layer, budget, step):
        out = keep(layer, budget, step)
        if layer.layer_idx == 0 and "selected" in layer.derived:
            selections.append((layer.physical_length(), layer.derived["selected"].rows.clone()))
        return out

    mt_method.keep = spy
    held = []
    prefill = Session.prefill

    def record_prefill(self, ids, compress):
        out = prefill(self, ids, compress)
        held.append((compress, [layer.lengths() for layer in self.cache.layers], self.plan))
        return out

    Session.prefill = record_prefill
    try:
        plain = run_sample(tiny_llama, plain_method, 64, sample, cfg)
        plain_held, held[:] = list(held), []
        mt = run_sample(tiny_llama, mt_method, 64, sample, cfg)
    finally:
        Session.prefill = prefill
    # plain RocketKV: every turn's input is re-compressed to the stage-1 budget; never more than the capacity
    plan = plain["budget_plan"]
    compressed = [lengths for compress, lengths, _ in plain_held if compress]
    assert len(compressed) == 3  # the first prompt and the two later turns' inputs
    for lengths in compressed:
        assert all(n == plan["evict"] for layer in lengths for n in layer)
    assert plain["kept_tokens_end_max"] <= plan["capacity"]
    # RocketKV-MT: three selections (one per turn), each over the whole history at that moment
    assert len(selections) == 3
    lengths = [n for n, _ in selections]
    assert lengths[0] < lengths[1] < lengths[2]
    for n, rows in selections:
        assert rows.shape[1] == plan["evict"] and int(rows.max()) < n
    assert int(selections[2][1].min()) < int(selections[2][1].max())  # old and new tokens compete
    # the full history is intact: the cache holds every token of every turn (bytes measured)
    per_token = mt["kv_bytes_full_prompt"] / mt["prompt_tokens"]
    assert mt["kv_bytes_end"] >= per_token * (mt["prompt_tokens"] + 2 * 8)
    assert plain["kv_bytes_end"] < mt["kv_bytes_end"] / 2
    assert mt["eviction_events"] == 0 and plain["eviction_events"] >= 3


def test_exact_topk_has_the_highest_recall_and_traffic_follows_the_budget(tiny_llama):
    sample = Sample(id="s", task="synthetic", context="".join(chr(97 + i % 26) for i in range(700)),
                    turns=[Turn("Which letter?", ["a"], max_new_tokens=12, metric="string_match_all")])
    records = {name: run_sample(tiny_llama, build_method(name), 64, sample, EngineConfig(nll=False))
               for name in SPARSE + ["full"]}
    assert records["exact_topk"]["topk_recall"] == pytest.approx(1.0)
    for name in SPARSE:
        assert 0 < records[name]["topk_recall"] <= records["exact_topk"]["topk_recall"] + 1e-6, name
        assert records[name]["budget_plan"]["select"] == 64
    assert records["full"]["topk_recall"] is None
    # traffic per KV group and step, in token-equivalents: the budget t (estimate included), not the cache
    for name in ("quest", "sparq", "hsa", "rocketkv", "rocketkv_mt"):
        assert records[name]["decode_read_tokens_per_group"] <= 64 * 1.1, name
    assert records["full"]["decode_read_tokens_per_group"] > records["full"]["prompt_tokens"]
    # storage (Table 1 convention): Quest 1 + 1/c, SparQ 2, RocketKV well under 1
    assert 1.0 < records["quest"]["storage_ratio_table1"] < 1.2
    assert 1.9 < records["sparq"]["storage_ratio_table1"] <= 2.01
    rocket = records["rocketkv"]
    kept, page, seq = rocket["kept_tokens_end_mean"], rocket["budget_plan"]["page_size"], rocket["budget_plan"]["sequence_length"]
    assert rocket["storage_ratio_table1"] == pytest.approx((kept + 2 * -(-kept // page)) / seq)  # kept + 2 bounds per page
    assert rocket["storage_ratio_table1"] < 1 < records["rocketkv_mt"]["storage_ratio_table1"]
    assert records["rocketkv"]["budget_plan"]["prompt_budget"] == records["rocketkv"]["budget_plan"]["evict"]


@pytest.mark.parametrize("name", ["quest", "sparq", "hsa", "rocketkv", "rocketkv_mt"])
def test_decode_logits_equal_attention_over_exactly_the_selected_tokens(tiny, name):
    """Each decode step's logits equal a dense eager run in which every query head sees exactly the tokens the
    method selected for it at that step (SparQ without reallocation, which adds a mean-value term)."""
    params = {"reallocation": False} if name == "sparq" else {"last_prompt_token_via_decode": False} if "rocket" in name else {}
    method = build_method(name, **params)
    chosen: list[dict[int, torch.Tensor]] = []
    select = method.select

    def spy(layer, q, view, step, scaling):
        idx = select(layer, q, view, step, scaling)
        if idx is not None:
            mask = torch.zeros(q.shape[0] * q.shape[1], layer.seen, dtype=torch.bool)
            positions = view.positions.repeat_interleave(q.shape[1], dim=0)
            flat = idx.reshape(-1, idx.shape[-1])
            for h in range(mask.shape[0]):
                mask[h, positions[h, flat[h]].long()] = True
            chosen[-1][layer.layer_idx] = mask
        return idx

    method.select = spy
    ids = random_ids(PROMPT, seed=56)
    session = Session(tiny, method, 48, sequence_length=PROMPT + 48)
    logits, _ = session.prefill(ids, compress=True)
    chunks, past, outs = [ids], [None], [logits]
    for _ in range(5):
        token = int(outs[-1].argmax())
        chosen.append({})
        outs.append(session.step(token))
        chunks.append([token])
        past.append(chosen[-1] or kept_masks(session.cache, session.position - 1))
    assert all(step for step in chosen)
    for ours, theirs in zip(outs, reference_chunks(tiny.model, chunks, past)):
        torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-5)


def test_per_query_head_snapkv_stores_the_budget_per_group_in_table1_terms(tiny_llama):
    """RocketKV Table 1: SnapKV stores 1/c whether a group's budget is shared or split over its query heads."""
    sample = Sample(id="s", task="synthetic", context="".join(chr(97 + i % 26) for i in range(700)),
                    turns=[Turn("Which letter?", ["a"], max_new_tokens=4, metric="string_match_all")])
    records = {g: run_sample(tiny_llama, build_method("snapkv", granularity=g), 64, sample, EngineConfig(nll=False))
               for g in ("group", "head")}
    for record in records.values():
        # no auxiliary state: the convention's ratio is the true bytes' ratio
        assert record["storage_ratio_table1"] == pytest.approx(record["storage_ratio_bytes"])
    # the same budget per group; only the few decoded tokens are stored once per query head
    assert records["head"]["storage_ratio_table1"] == pytest.approx(records["group"]["storage_ratio_table1"], rel=0.1)
