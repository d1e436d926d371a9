"""The one decode attention (`kvbench.kernels.decode_attention`) against its reference, the stock SDPA call in
float32, and the model-level fast path against the reference path; blocked bfloat16 linears; page-level top-k."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kvbench.cache.dynamic as dynamic_layer
import kvbench.kernels.decode_attention as decode_attention_module
import kvbench.models as models
from kvbench.core.errors import KVBenchError
from kvbench.engine.session import Session
from kvbench.kernels.decode_attention import (
    WIDTH_STEP,
    decode_attention,
    decode_attention_matmul,
    decode_attention_reference,
)
from kvbench.methods import build_method
from kvbench.methods.common.pages import page_tokens, top_page_tokens, top_tokens
from kvbench.models import (
    PackedProduct,
    fast_cpu_bfloat16,
    load_model,
    model_head_dim,
    pack_linear_weights,
    pack_projections,
)
from tests.conftest import model_cfg, random_ids

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _layout(gen, lens, caps, dim, dtype, garbage=1e3):
    """Flat buffers with each head's rows followed by finite garbage up to its capacity."""
    starts = [sum(caps[:h]) for h in range(len(caps))]
    keys = torch.full((sum(caps), dim), garbage)
    values = torch.full((sum(caps), dim), -garbage)
    for s, n in zip(starts, lens):
        keys[s:s + n] = torch.randn(n, dim, generator=gen)
        values[s:s + n] = torch.randn(n, dim, generator=gen)
    return keys.to(dtype), values.to(dtype), starts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens,caps", [([50] * 3, [50] * 3), ([50] * 3, [130] * 3), ([7, 1, 200], [9, 70, 300]),
                                       ([63, 64, 65], [63, 128, 200])])
@pytest.mark.parametrize("padded_copy_rows", [0, 4096])  # ragged low-precision: per-head calls / one padded batch
@pytest.mark.parametrize("cpu_sdpa", [False, True])  # bf16: the matmul path / SDPA (CPUs with AMX)
def test_decode_attention_matches_reference(dtype, lens, caps, padded_copy_rows, cpu_sdpa, monkeypatch):
    monkeypatch.setattr(decode_attention_module, "PADDED_COPY_ROWS", padded_copy_rows)
    monkeypatch.setattr(decode_attention_module, "LOW_PRECISION_CPU_SDPA", cpu_sdpa)
    gen = torch.Generator().manual_seed(len(lens) + sum(caps))
    keys, values, starts = _layout(gen, lens, caps, 16, dtype)
    q = torch.randn(len(lens), 4, 16, generator=gen).to(dtype)
    out = decode_attention(q, keys, values, 0.25, starts, lens, caps)
    exact = decode_attention_reference(q.float(), keys.float(), values.float(), 0.25, starts, lens)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), exact, **TOL[dtype])  # the garbage past each length has no weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_uniform_decode_is_the_stock_sdpa_call_in_float32_and_in_bfloat16_on_amx(dtype, monkeypatch):
    monkeypatch.setattr(decode_attention_module, "LOW_PRECISION_CPU_SDPA", True)
    assert decode_attention_module.decode_attention_kind(dtype, torch.device("cpu")) == "sdpa"
    gen = torch.Generator().manual_seed(3)
    heads, group, length, cap, dim = 3, 3, 40, 57, 16
    keys, values, starts = _layout(gen, [length] * heads, [cap] * heads, dim, dtype)
    query = torch.randn(1, heads * group, 1, dim, generator=gen).to(dtype)  # as transformers passes it
    view = lambda t: t.view(heads, cap, dim)[None, :, :length]  # noqa: E731  (the layer's [1, H, L, D] view)
    stock = F.scaled_dot_product_attention(query, view(keys), view(values), scale=0.3, enable_gqa=True)
    out = decode_attention(query[0, :, 0].view(heads, group, dim), keys, values, 0.3, starts, [length] * heads,
                           [cap] * heads)
    assert torch.equal(out.reshape(1, -1, 1, dim), stock)


def test_the_decode_attention_kind_follows_the_dtype_and_the_cpu_kind(monkeypatch):
    cpu = torch.device("cpu")
    for amx in (False, True):
        monkeypatch.setattr(decode_attention_module, "LOW_PRECISION_CPU_SDPA", amx)
        kinds = {dtype: decode_attention_module.decode_attention_kind(dtype, cpu)
                 for dtype in (torch.float32, torch.bfloat16, torch.float16)}
        assert kinds == {torch.float32: "sdpa", torch.bfloat16: "sdpa" if amx else "matmul", torch.float16: "matmul"}


def test_low_precision_width_steps_do_not_change_the_result():
    # the matmul path reads whole WIDTH_STEP blocks: the rows past the length get exactly zero weight
    gen = torch.Generator().manual_seed(5)
    keys = torch.randn(2, 3 * WIDTH_STEP, 32, generator=gen).bfloat16()
    values = torch.randn(2, 3 * WIDTH_STEP, 32, generator=gen).bfloat16()
    q = torch.randn(2, 3, 32, generator=gen).bfloat16()
    length = WIDTH_STEP + 5
    exact_width = decode_attention_matmul(q, keys, values, 0.2, length, length)
    for width in (2 * WIDTH_STEP, 3 * WIDTH_STEP):
        torch.testing.assert_close(decode_attention_matmul(q, keys, values, 0.2, length, width), exact_width,
                                   atol=1e-2, rtol=0)


def test_decode_attention_rejects_a_bad_layout():
    q, keys = torch.randn(2, 4, 16), torch.randn(10, 16)
    with pytest.raises(ValueError, match="decode attention layout"):
        decode_attention(q, keys, keys, 0.5, [0, 5], [5, 6], [5, 5])  # a head longer than its capacity


def _greedy(lm, method: str, ids: list[int], steps: int = 6) -> tuple[list[int], list[torch.Tensor]]:
    session = Session(lm, build_method(method), build_method(method).plan(
        48, sequence_length=len(ids) + steps, new_tokens=steps, head_dim=model_head_dim(lm)))
    logits, _ = session.prefill(ids, compress=True)
    tokens, all_logits = [], []
    for _ in range(steps):
        tokens.append(int(logits.argmax()))
        all_logits.append(logits.float())
        logits = session.step(tokens[-1])
    return tokens, all_logits


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen3"])
@pytest.mark.parametrize("method", ["full", "snapkv", "adakv", "quest"])
@pytest.mark.parametrize("cpu_sdpa", [False, True])
def test_bfloat16_fast_path_matches_the_reference_path(model, method, cpu_sdpa, monkeypatch):
    """The model in bfloat16 through the one decode attention (either CPU kind's) and through its float32
    reference: the same greedy tokens and logits within bfloat16's tolerance (the test grid: both tiny models,
    four methods)."""
    monkeypatch.setattr(decode_attention_module, "LOW_PRECISION_CPU_SDPA", cpu_sdpa)
    lm = load_model(model_cfg(model, dtype="bfloat16"))
    ids = random_ids(120, seed=11)
    fast_tokens, fast_logits = _greedy(lm, method, ids)
    monkeypatch.setattr(dynamic_layer, "decode_attention", decode_attention_reference)
    ref_tokens, ref_logits = _greedy(lm, method, ids)
    assert fast_tokens == ref_tokens
    for fast, ref in zip(fast_logits, ref_logits):
        torch.testing.assert_close(fast, ref, atol=0.1, rtol=0.05)


@pytest.mark.skipif(not fast_cpu_bfloat16(), reason="oneDNN has no native bfloat16 on this CPU")
@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen3"])
def test_blocked_and_packed_bfloat16_linears_are_bitwise_stock(model, monkeypatch):
    lm = load_model(model_cfg(model, dtype="bfloat16"))  # loaded with blocked, packed weights
    monkeypatch.setattr(models, "pack_linear_weights", lambda module: None)
    stock = load_model(model_cfg(model, dtype="bfloat16"))  # plain F.linear
    packed = [m for m in lm.model.modules() if isinstance(m, PackedProduct)]
    assert len(packed) == 2 * lm.model.config.num_hidden_layers
    ids = torch.tensor([random_ids(40, seed=2)])
    with torch.inference_mode():
        for chunk in (ids, ids[:, :1]):  # prefill-sized and decode-sized products
            assert torch.equal(_logits(lm, chunk), _logits(stock, chunk))
    assert all(m._output is None and m._input is None for m in packed)  # no activation outlives its layer


@pytest.mark.skipif(not fast_cpu_bfloat16(), reason="oneDNN has no native bfloat16 on this CPU")
def test_packed_projections_serve_any_call_order_and_input():
    gen = torch.Generator().manual_seed(0)
    parent = torch.nn.Module()
    for name, out in (("q_proj", 8), ("k_proj", 4), ("v_proj", 4)):
        setattr(parent, name, torch.nn.Linear(16, out, bias=True).bfloat16())
    weights = {name: (getattr(parent, name).weight.detach().clone(), getattr(parent, name).bias.detach().clone())
               for name in ("q_proj", "k_proj", "v_proj")}
    pack_linear_weights(parent)
    x, y = (torch.randn(1, 3, 16, generator=gen).bfloat16() for _ in range(2))
    with torch.inference_mode():
        for name, inp in (("v_proj", x), ("q_proj", y), ("k_proj", x), ("q_proj", x), ("q_proj", x)):
            expected = torch.nn.functional.linear(inp, *weights[name])
            torch.testing.assert_close(getattr(parent, name)(inp), expected, atol=2e-2, rtol=2e-2)
    assert parent.q_proj.weight is None and sum(p.numel() for p in parent.parameters()) == 16 * 16 + 16


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen3"])
def test_dense_stacked_projections_keep_the_models_tokens_eager_and_compiled(model, monkeypatch):
    """`pack_projections` (what a CUDA model in 16-bit floats gets): q/k/v and gate/up become one dense product
    each, holding the same parameters; greedy decoding keeps the unstacked model's tokens (its logits within
    bf16 rounding: the stacked sums may round otherwise), and the compiled step traces the stacked products."""
    from kvbench.engine import compiled

    monkeypatch.setattr(models, "pack_linear_weights", lambda module: None)  # plain F.linear layers on any CPU
    stock, lm = (load_model(model_cfg(model, dtype="bfloat16")) for _ in range(2))
    count = sum(p.numel() for p in lm.model.parameters())
    pack_projections(lm.model)
    packed = [m for m in lm.model.modules() if isinstance(m, PackedProduct)]
    assert len(packed) == 2 * lm.model.config.num_hidden_layers and not any(m.blocked for m in packed)
    assert sum(p.numel() for p in lm.model.parameters()) == count and all(m.weight.is_contiguous() for m in packed)
    ids = random_ids(120, seed=11)
    tokens, logits = _greedy(lm, "snapkv", ids)
    stock_tokens, stock_logits = _greedy(stock, "snapkv", ids)
    assert tokens == stock_tokens
    for ours, theirs in zip(logits, stock_logits):
        torch.testing.assert_close(ours, theirs, atol=0.1, rtol=0.05)
    session = Session(lm, build_method("snapkv"), 48)
    first, _ = session.prefill(ids, compress=True)
    session.decoder = compiled.CompiledDecoder(lm, "eager")
    session.begin_decode(5)
    replayed = [int(first.argmax())]
    for _ in range(5):
        replayed.append(int(session.step(replayed[-1]).argmax()))
    session.end_decode()
    assert session.decode_path == "compiled" and session.compiles == 1 and replayed == tokens  # one graph
    assert all(m._output is None and m._input is None for m in packed)  # no activation outlives its layer


def _logits(lm, ids: torch.Tensor) -> torch.Tensor:
    session = Session(lm, build_method("full"), None)
    return session.prefill(ids[0].tolist(), compress=False)[0]


def test_page_level_top_k_is_the_token_level_top_k():
    gen = torch.Generator().manual_seed(0)
    for _ in range(500):
        heads, page = int(torch.randint(1, 4, (1,), generator=gen)), int(torch.randint(1, 9, (1,), generator=gen))
        length = int(torch.randint(1, 80, (1,), generator=gen))
        scores = torch.randint(0, 4, (heads, -(-length // page)), generator=gen).float()  # many ties
        k = int(torch.randint(1, length + 3, (1,), generator=gen))
        assert torch.equal(top_page_tokens(scores, page, length, k), top_tokens(page_tokens(scores, page, length), k))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_top_tokens_are_the_stable_sorts_first_k(dtype):
    """Ties (many at the k-th value), -0.0 against 0.0, negative scores, -inf and +inf: the same indices in the
    same order as a stable descending sort, eagerly and traced."""
    gen = torch.Generator().manual_seed(1)
    torch._dynamo.reset()  # the graphs of the other dtype's run
    traced = torch.compile(top_tokens, backend="eager", fullgraph=True, dynamic=False)
    for trial in range(300):
        heads, length = 1 + trial % 4, int(torch.randint(1, 400, (1,), generator=gen))
        scores = torch.softmax(torch.randn(heads, length, generator=gen), dim=-1)
        if trial % 2:
            scores = (scores * 40).round() / 40 - (trial % 4 == 1) * 0.01  # many ties at the k-th value
        scores[:, ::7], scores[:, 1::11], scores[:, 2::13], scores[:, 3::17] = 0.0, -0.0, float("-inf"), float("inf")
        scores = scores.to(dtype)
        k = int(torch.randint(1, length + 3, (1,), generator=gen))
        want = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
        assert torch.equal(top_tokens(scores, k), want)
        if trial < 6:  # each shape is a new graph (dynamo allows 8 per function)
            assert torch.equal(traced(scores, k), want)


def test_full_with_repeated_kv_is_full_at_group_times_the_traffic(tiny_llama):
    """gpt-fast's dense baseline: the same attention over K/V copied to every query head; it reads G times."""
    ids = random_ids(60, seed=4)
    runs = {}
    for repeat in (None, True):
        method = build_method("full", repeat_kv=repeat)
        session = Session(tiny_llama, method, method.plan(None, sequence_length=70, new_tokens=4, head_dim=16))
        logits, _ = session.prefill(ids, compress=True)
        steps = [session.step(int(logits.argmax())) for _ in range(3)]
        runs[repeat] = (steps, session.cache.stats.read_elements)
    config = tiny_llama.model.config
    group = config.num_attention_heads // config.num_key_value_heads
    for a, b in zip(runs[None][0], runs[True][0]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert group > 1 and runs[True][1] == group * runs[None][1]
    with pytest.raises(KVBenchError, match="repeat_kv"):
        build_method("full", repeat_kv="yes")
