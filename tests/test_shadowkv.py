"""ShadowKV: low-rank pre-RoPE keys, values in host memory, landmark chunk selection (tiny random models)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from conftest import CONF, model_cfg, random_ids
from test_retrieval_methods import kv_turns

from kvbench.engine.config import EngineConfig
from kvbench.engine.sample import run_sample
from kvbench.engine.session import Session
from kvbench.methods import build_method
from kvbench.methods.common.blocks import unrope
from kvbench.methods.shadowkv import low_rank_factors, shadowkv_rank

PROMPT = 400
SMALL = {"outlier_chunks": 4}  # 400 tokens = 46 chunks of 8 + 4 local chunks + the remainder: 48 outliers is all


def decode(session: Session, logits: torch.Tensor, steps: int) -> list[torch.Tensor]:
    outs = [logits]
    for _ in range(steps):
        outs.append(session.step(int(outs[-1].argmax())))
    return outs


def dense_session(lm, ids) -> tuple[Session, torch.Tensor]:
    session = Session(lm, build_method("full"), None)
    return session, session.prefill(ids, compress=True)[0]


def spy_selections(method) -> list:
    seen = []
    select = method.select

    def spy(layer, q, view, step, scaling):
        out = select(layer, q, view, step, scaling)
        seen.append((layer.layer_idx, q.clone(), out, view.keys.shape[1]))
        return out

    method.select = spy
    return seen


# KV heads x head dim of every shipped model config (their config.json; the random ones' from conf/model). A model
# config added without its geometry here fails test_the_releases_rank_on_every_shipped_model.
KEY_GEOMETRY = {"smollm2_135m": (3, 64), "tiny_llama": (2, 16), "tiny_qwen3": (2, 16), "llama3.1_8b_instruct": (8, 128),
                "llama3.2_3b_instruct": (8, 128), "llama3_8b_262k": (8, 128), "mistral_7b_instruct_v0.2": (8, 128),
                "longchat_7b_v1.5_32k": (32, 128), "yi_9b_200k": (4, 128), "deepseek_r1_distill_llama_8b": (8, 128),
                "deepseek_r1_distill_qwen_7b": (4, 128), "qwen2.5_7b_instruct": (4, 128), "qwen2.5_3b_instruct": (2, 128),
                "llama3_8b_instruct_gradient_1048k": (8, 128), "llama3.1_70b_instruct": (8, 128)}


def test_the_releases_rank_on_every_shipped_model():
    """The release factors every model's keys at rank 160 (models/*.py: rank=160); kvbench too, where the key
    width allows it, by default. `rank: scaled` (kvbench's former rule) halves it on Yi-9B-200K's 4 x 128 keys."""
    from omegaconf import OmegaConf

    assert {p.stem for p in (CONF / "model").glob("*.yaml")} == set(KEY_GEOMETRY)
    for name in ("tiny_llama", "tiny_qwen3"):
        config = model_cfg(name).config
        assert KEY_GEOMETRY[name] == (config.num_key_value_heads, config.head_dim)
    default = OmegaConf.load(CONF / "method" / "shadowkv.yaml").rank
    assert default == 160 and build_method("shadowkv").rank == 160
    for name, (heads, dim) in KEY_GEOMETRY.items():
        assert shadowkv_rank(default, heads, dim) == min(160, heads * dim), name
        if heads * dim >= 160:
            assert shadowkv_rank(default, heads, dim) == 160, name
    assert shadowkv_rank("scaled", 4, 128) == 80 and shadowkv_rank("scaled", 8, 128) == 160
    assert shadowkv_rank("scaled", 3, 64) == 30 and shadowkv_rank(96, 3, 64) == 96


def test_the_default_rank_is_capped_by_the_key_width_in_a_run(tiny_llama):
    session = Session(tiny_llama, build_method("shadowkv", **SMALL), 64, sequence_length=PROMPT + 8)
    session.prefill(random_ids(PROMPT, seed=75), compress=True)
    assert {layer.derived["shadowkv"].u.shape[1] for layer in session.cache.layers} == {2 * 16}
    assert session.plan.derived["rank"] == 160


def test_low_rank_factors_leave_exactly_the_truncation_error_and_nothing_at_full_rank():
    """Eckart-Young: the rank-r factors miss the keys by the Frobenius norm of the discarded singular values."""
    keys = torch.randn(3, 70, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64).float()
    flat = keys.transpose(0, 1).reshape(70, 24)
    for rank in (1, 5, 24):
        u, sv, s = low_rank_factors(keys, rank)
        assert u.shape == (70, rank) and sv.shape == (3, rank, 8)
        rebuilt = torch.einsum("nr,hrd->hnd", u, sv)
        error = float(torch.linalg.norm(rebuilt - keys))
        torch.testing.assert_close(error, float(s[rank:].square().sum().sqrt()), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(s, torch.linalg.svdvals(flat))
    assert error < 1e-4  # full rank


@pytest.mark.parametrize("rank", [3, 32])
def test_stored_factors_rebuild_the_layers_pre_rope_keys_within_the_truncation_error(tiny, rank):
    ids = random_ids(PROMPT, seed=70)
    dense, _ = dense_session(tiny, ids)
    session = Session(tiny, build_method("shadowkv", **SMALL, rank=rank), 64, sequence_length=PROMPT + 8)
    session.prefill(ids, compress=True)
    for layer, full in zip(session.cache.layers, dense.cache.layers):
        view = full.head_view()
        pre = unrope(view.keys, view.positions, session.rotary)  # [H, n, D]
        state = layer.derived["shadowkv"]
        assert state.u.shape == (PROMPT, rank) and state.sv.shape == (layer.num_heads, rank, layer.head_dim)
        rebuilt = torch.einsum("nr,hrd->hnd", state.u.float(), state.sv.float())
        singular = torch.linalg.svdvals(pre.transpose(0, 1).reshape(PROMPT, -1))
        discarded = float(singular[rank:].square().sum().sqrt())
        torch.testing.assert_close(float(torch.linalg.norm(rebuilt - pre)), discarded, atol=2e-4, rtol=1e-3)
        # keys rebuilt at their positions are the post-RoPE keys (exactly so at full rank)
        positions = torch.arange(PROMPT).expand(layer.num_heads, -1)
        error = float(torch.linalg.norm(state.keys(positions, session.rotary) - view.keys))
        noise = 1e-5 * float(torch.linalg.norm(view.keys))  # fp32 rounding of the SVD and the rotations
        assert error <= discarded * 1.001 + noise and (rank < 32 or error < noise)


def test_full_rank_and_a_budget_covering_every_chunk_is_full_attention(tiny):
    ids = random_ids(PROMPT, seed=71)
    dense, logits = dense_session(tiny, ids)
    method = build_method("shadowkv", **SMALL, rank=32)
    seen = spy_selections(method)
    budget = (46 - 4) * 8  # every non-outlier chunk, below the sequence (not short-cut to full)
    session = Session(tiny, method, budget, sequence_length=PROMPT + 8)
    outs = decode(session, session.prefill(ids, compress=True)[0], 6)
    for ours, theirs in zip(outs, decode(dense, logits, 6)):
        torch.testing.assert_close(ours, theirs, atol=5e-5, rtol=1e-5)
    assert seen and all(sel.external[0].shape[1] == budget for _, _, sel, _ in seen)


@pytest.mark.parametrize("params", [SMALL, {"low_rank": False, "outlier_chunks": 0}])
def test_budget_at_or_above_the_sequence_is_bitwise_full(tiny, params):
    ids = random_ids(PROMPT, seed=72)
    session = Session(tiny, build_method("shadowkv", **params), PROMPT + 6, sequence_length=PROMPT + 6)
    assert session.plan.derived == {"full_attention": True}
    outs = decode(session, session.prefill(ids, compress=True)[0], 6)
    dense, logits = dense_session(tiny, ids)
    assert all(torch.equal(a, b) for a, b in zip(outs, decode(dense, logits, 6)))


def test_sinks_outlier_chunks_and_local_window_stay_resident_and_exact(tiny_llama):
    ids = random_ids(PROMPT + 7, seed=73)  # after 4 sinks, a remainder of 3 joins the local window
    dense, _ = dense_session(tiny_llama, ids)
    session = Session(tiny_llama, build_method("shadowkv", outlier_chunks=5, sink_tokens=4), 64,
                      sequence_length=PROMPT + 10)
    session.prefill(ids, compress=True)
    n, start, chunks = PROMPT + 7, 4, (PROMPT + 7 - 4) // 8 - 4
    end = start + chunks * 8
    assert n - end == 4 * 8 + 3
    for layer, full in zip(session.cache.layers, dense.cache.layers):
        keys, values = full.head_view().keys, full.head_view().values
        ctx = keys[:, start:end].view(layer.num_heads, chunks, 8, -1)
        worst = F.cosine_similarity(ctx.mean(2, keepdim=True), ctx, dim=-1).amin(-1)  # the repo's criterion
        state = layer.derived["shadowkv"]
        for h in range(layer.num_heads):
            outliers = worst[h].topk(5, largest=False).indices.sort().values
            assert torch.equal(state.outliers[h], outliers)
            expected = set(range(start)) | set(range(end, n)) | {start + 8 * int(c) + i for c in outliers for i in range(8)}
            stored = layer.head_view().positions[h]
            assert set(stored.tolist()) == expected and len(stored) == len(expected)
            assert torch.equal(layer.head_view().keys[h], keys[h, stored]) and torch.equal(layer.head_view().values[h], values[h, stored])
            # the other chunks' landmarks are their post-RoPE key means, their values on the host
            rest = state.chunk_ids[h]
            assert set(rest.tolist()) == set(range(chunks)) - set(outliers.tolist())
            torch.testing.assert_close(state.landmarks[h], ctx[h, rest].mean(1))
            assert torch.equal(layer.derived["shadowkv_values"].values[h], values[h, start:end].view(chunks, 8, -1)[rest])


def test_each_step_attends_to_the_top_chunks_by_landmark_with_their_rebuilt_keys_and_host_values(tiny_llama):
    ids = random_ids(PROMPT, seed=74)
    dense, _ = dense_session(tiny_llama, ids)
    method = build_method("shadowkv", **SMALL, rank=32)
    seen = spy_selections(method)
    session = Session(tiny_llama, method, 40, sequence_length=PROMPT + 8)  # 5 chunks per head
    decode(session, session.prefill(ids, compress=True)[0], 3)
    for layer_idx, q, sel, length in seen:
        layer, full = session.cache.layers[layer_idx], dense.cache.layers[layer_idx]
        state = layer.derived["shadowkv"]
        probs = torch.softmax(torch.einsum("hgd,hcd->hgc", q, state.landmarks) * layer.scaling, -1).amax(1)
        keys, values = sel.external
        assert keys.shape[1] == 40 and torch.equal(sel.idx[0, 0], torch.arange(length))  # every resident row too
        for h in range(layer.num_heads):
            chunks = state.chunk_ids[h, probs[h].topk(5).indices]
            rows = (chunks[:, None] * 8 + torch.arange(8)).flatten()
            torch.testing.assert_close(keys[h], full.head_view().keys[h, rows], atol=1e-4, rtol=1e-4)
            assert torch.equal(values[h], full.head_view().values[h, rows])


def test_landmark_variant_keeps_everything_and_attends_to_resident_plus_top_chunks(tiny_llama):
    method = build_method("shadowkv", low_rank=False, outlier_chunks=0)
    seen = spy_selections(method)
    session = Session(tiny_llama, method, 64, sequence_length=PROMPT + 8)
    decode(session, session.prefill(random_ids(PROMPT, seed=75), compress=True)[0], 3)
    assert session.cache.evictions() == 0 and set(session.cache.layers[0].derived) == {"shadowkv"}
    for layer_idx, q, sel, length in seen:
        layer = session.cache.layers[layer_idx]
        state = layer.derived["shadowkv"]
        probs = torch.softmax(torch.einsum("hgd,hcd->hgc", q, state.landmarks) * layer.scaling, -1).amax(1)
        assert sel.external is None
        for h in range(layer.num_heads):
            chunks = probs[h].topk(8).indices
            top = {8 * int(c) + i for c in chunks for i in range(8)}
            assert set(sel.idx[h, 0].tolist()) == top | set(range(state.end, length))


def test_memory_is_freed_and_the_values_are_host_bytes(tiny_llama):
    ids = random_ids(PROMPT, seed=76)
    session = Session(tiny_llama, build_method("shadowkv", **SMALL), 64, sequence_length=PROMPT + 8)
    session.prefill(ids, compress=False)  # dense, then the event by hand
    full_bytes = session.cache.kv_bytes()
    dense_keys = [weakref.ref(layer.buffers["keys"]) for layer in session.cache.layers]
    session.evict_deferred()
    gc.collect()
    assert all(ref() is None for ref in dense_keys), "the dense storage must be freed"
    resident = 4 * 8 + 4 * 8 + PROMPT % 8  # outliers, local chunks, remainder
    assert all(layer.lengths() == [resident] * 2 for layer in session.cache.layers)
    assert session.cache.kv_bytes() == full_bytes * resident // PROMPT
    host = [layer.derived["shadowkv_values"] for layer in session.cache.layers]
    assert all(h.values.shape == (2, 42, 8, 16) and h.on_host for h in host)
    # rank 5 of the 32-wide keys (`scaled`): the release's 160 would be the whole width here, factors bigger than keys
    record = run_sample(session.lm, build_method("shadowkv", **SMALL, rank="scaled"), 64, kv_turns(1),
                        EngineConfig(nll=False))
    assert record["host_bytes_end"] > 0 and record["device_bytes_end"] > 0
    assert record["decode_read_tokens_per_group"] > 64  # the sparse budget plus landmarks, factors, resident rows
    assert 0 < record["storage_ratio_table1"] < 1


def test_greedy_multi_turn_and_question_agnostic_runs(tiny):
    record = run_sample(tiny, build_method("shadowkv", **SMALL), 32, kv_turns(2), EngineConfig(nll=False))
    assert len(record["turns"]) == 2 and record["topk_recall"] is not None
    assert record["decode_method_stats"]["selected_chunks"] == 4
    agnostic = run_sample(tiny, build_method("shadowkv", low_rank=False, outlier_chunks=0), 32, kv_turns(1),
                          EngineConfig(compress_question=False))
    assert agnostic["nll"] is not None and agnostic["decode_read_tokens_per_group"] > 0


def test_low_rank_mode_refuses_a_model_without_rope(tiny_llama):
    session = Session(tiny_llama, build_method("shadowkv", **SMALL), 64, sequence_length=PROMPT + 8)
    session.rotary = None
    with pytest.raises(ValueError, match="rotary"):
        session.prefill(random_ids(PROMPT, seed=77), compress=True)
