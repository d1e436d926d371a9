"""Triton decode kernels vs their PyTorch references (Triton interpreter on CPU), references vs dense oracles.

triton reads TRITON_INTERPRET once, when it is imported (its standard library, tl.sum, tl.max..., is
jitted then): conftest sets it before anything imports triton, and this module sets it too for
`--noconftest` runs. The Triton launchers are called directly: the dispatchers pick the references on CPU
tensors.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from kvbench.kernels._dispatch import ENV_VAR, use_triton
from kvbench.kernels.ragged_attention import (
    ragged_decode_attention,
    ragged_decode_attention_reference,
    ragged_decode_attention_triton,
)
from kvbench.kernels.sparse_attention import (
    topk_attention,
    topk_attention_reference,
    topk_attention_triton,
)

from kvbench.cache import KVBenchCache

pytestmark = pytest.mark.kernels

FP32_TOL = {"atol": 1e-5, "rtol": 1e-5}
# a bf16 output is the fp32 result cast once: within one ulp (2^-7 relative), not half of one, because the
# Triton interpreter truncates fp32 -> bf16 casts (compiled kernels round to nearest)
BF16_TOL = {"atol": 1e-6, "rtol": 2.0**-7 + 1e-5}


def _close_to_fp32(out: torch.Tensor, exact: torch.Tensor) -> None:
    """`out` (in its own dtype) matches the fp32 result `exact` up to that dtype's output rounding."""
    torch.testing.assert_close(out.float(), exact, **(FP32_TOL if out.dtype == torch.float32 else BF16_TOL))


def _randn(gen: torch.Generator, *shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype)


# -- top-k attention ------------------------------------------------------------------------------------


def _dense_topk(q, keys, values, idx, scaling, valid=None):
    """Oracle: full-length fp64 logits, everything but the (distinct) selected valid slots masked to -inf."""
    logits = torch.einsum("hgd,hld->hgl", q.double(), keys.double()) * scaling
    keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, idx, True)
    if valid is not None:
        keep &= valid[:, None, :]
    probs = torch.softmax(logits.masked_fill(~keep, float("-inf")), -1)
    return torch.einsum("hgl,hld->hgd", probs, values.double()).float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "n_kv, group, length, dim, k, block_k",
    [
        (2, 4, 300, 64, 37, 16),  # odd k spanning three blocks, the last one partial
        (3, 1, 97, 16, 1, 64),  # a single selected token
        (1, 4, 300, 16, 300, 64),  # every token selected
        (2, 2, 50, 80, 23, 8),  # head dim not a power of two (masked lanes)
    ],
)
def test_topk_triton_matches_reference(n_kv, group, length, dim, k, block_k, dtype):
    gen = torch.Generator().manual_seed(k + dim)
    q = _randn(gen, n_kv, group, dim, dtype=dtype)
    keys = _randn(gen, n_kv, length, dim, dtype=dtype)
    values = _randn(gen, n_kv, length, dim, dtype=dtype)
    idx = torch.randint(0, length, (n_kv, group, k), generator=gen)  # repeats allowed: they count repeatedly
    ours = topk_attention_triton(q, keys, values, idx, 0.3, block_k=block_k)
    ref = topk_attention_reference(q, keys, values, idx, 0.3)
    assert ours.dtype == ref.dtype == dtype and ours.shape == (n_kv, group, dim)
    _close_to_fp32(ours, topk_attention_reference(q.float(), keys.float(), values.float(), idx, 0.3))
    _close_to_fp32(ref, topk_attention_reference(q.float(), keys.float(), values.float(), idx, 0.3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_topk_selected_padding_gets_no_weight(dtype):
    n_kv, group, length, dim, k = 2, 4, 120, 16, 21
    gen = torch.Generator().manual_seed(1)
    q = _randn(gen, n_kv, group, dim, dtype=dtype)
    keys = _randn(gen, n_kv, length, dim, dtype=dtype)
    values = _randn(gen, n_kv, length, dim, dtype=dtype)
    lens = torch.tensor([length, 40])
    valid = torch.arange(length)[None, :] < lens[:, None]
    idx = torch.randint(0, length, (n_kv, group, k), generator=gen)
    # head 1, member 0: its first block (block_k=8) is all padding, then real tokens
    idx[1, 0, :8] = torch.arange(100, 108)
    idx[1, 0, 8:] = torch.arange(13)
    # padding rows hold huge values: any weight leaking onto them would show
    keys[1, 40:] = 1e4
    values[1, 40:] = 1e4
    ours = topk_attention_triton(q, keys, values, idx, 0.25, valid, block_k=8)
    ref = topk_attention_reference(q, keys, values, idx, 0.25, valid)
    exact = topk_attention_reference(q.float(), keys.float(), values.float(), idx, 0.25, valid)
    _close_to_fp32(ours, exact)
    _close_to_fp32(ref, exact)
    assert ours.float().abs().max() < 10


@pytest.mark.filterwarnings("ignore:invalid value encountered in divide")  # the expected 0/0
def test_topk_all_padding_selection_is_nan_in_both():
    q, keys, values = torch.randn(1, 2, 16), torch.randn(1, 10, 16), torch.randn(1, 10, 16)
    valid = torch.arange(10)[None, :] < 5
    idx = torch.tensor([[[5, 6, 7], [0, 8, 9]]])
    ours = topk_attention_triton(q, keys, values, idx, 0.25, valid)
    ref = topk_attention_reference(q, keys, values, idx, 0.25, valid)
    assert ours[0, 0].isnan().all() and ref[0, 0].isnan().all()
    torch.testing.assert_close(ours[0, 1], ref[0, 1], **FP32_TOL)


def test_topk_strided_inputs():
    # keys/values as column slices of wider rows and q transposed: the kernel honours every stride
    gen = torch.Generator().manual_seed(2)
    wide = torch.randn(2, 64, 48, generator=gen)
    keys, values = wide[..., :16], wide[..., 32:]
    q = torch.randn(4, 2, 16, generator=gen).transpose(0, 1)
    idx = torch.randint(0, 64, (2, 4, 13), generator=gen)
    torch.testing.assert_close(
        topk_attention_triton(q, keys, values, idx, 0.5, block_k=4),
        topk_attention_reference(q, keys, values, idx, 0.5),
        **FP32_TOL,
    )


@pytest.mark.parametrize("masked", [False, True])
def test_topk_reference_matches_dense_masked_softmax(masked):
    n_kv, group, length, dim, k = 3, 4, 200, 32, 25
    gen = torch.Generator().manual_seed(3)
    q, keys, values = (torch.randn(n_kv, s, dim, generator=gen) for s in (group, length, length))
    # distinct indices per query head: the dense oracle's mask cannot express a repeated one
    idx = torch.stack([torch.stack([torch.randperm(length, generator=gen)[:k] for _ in range(group)]) for _ in range(n_kv)])
    valid = torch.rand(n_kv, length, generator=gen) < 0.7 if masked else None
    if masked:
        valid.scatter_(1, idx[:, :, 0], True)  # each query head keeps at least one real token
    torch.testing.assert_close(
        topk_attention_reference(q, keys, values, idx, 0.2, valid), _dense_topk(q, keys, values, idx, 0.2, valid),
        **FP32_TOL,
    )


# -- ragged decode attention ----------------------------------------------------------------------------


def _ragged(gen, lens, group, dim, dtype, gap=0):
    """A flat ragged layer with heads back to back (gap rows of junk between heads when gap > 0)."""
    lens_t = torch.tensor(lens)
    offsets = torch.cumsum(lens_t + gap, 0) - lens_t - gap
    total = int(lens_t.sum()) + gap * len(lens)
    q = _randn(gen, len(lens), group, dim, dtype=dtype)
    return q, _randn(gen, total, dim, dtype=dtype), _randn(gen, total, dim, dtype=dtype), offsets


def _per_head_attention(q, keys, values, offsets, lens, scaling):
    """Oracle: slice each head's rows and run a plain fp64 softmax."""
    outs = []
    for h, (start, n) in enumerate(zip(offsets.tolist(), lens)):
        k, v = keys[start : start + n].double(), values[start : start + n].double()
        outs.append(torch.softmax(q[h].double() @ k.T * scaling, -1) @ v)
    return torch.stack(outs).float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "lens, group, dim, block_n",
    [
        ([1, 300, 17, 64], 4, 64, 32),  # lengths 1 .. 300, partial and exact blocks
        ([5, 1, 129], 1, 16, 64),
        ([300, 2], 4, 80, 16),  # head dim not a power of two
    ],
)
def test_ragged_triton_matches_reference(lens, group, dim, block_n, dtype):
    gen = torch.Generator().manual_seed(sum(lens))
    q, keys, values, offsets = _ragged(gen, lens, group, dim, dtype)
    ours = ragged_decode_attention_triton(q, keys, values, offsets, lens, 0.3, block_n=block_n)
    ref = ragged_decode_attention_reference(q, keys, values, offsets, lens, 0.3)
    assert ours.dtype == ref.dtype == dtype and ours.shape == q.shape
    exact = ragged_decode_attention_reference(q.float(), keys.float(), values.float(), offsets, lens, 0.3)
    _close_to_fp32(ours, exact)
    _close_to_fp32(ref, exact)


def test_ragged_gaps_and_tensor_lengths():
    # segments need not be contiguous; lengths may come as a tensor
    gen = torch.Generator().manual_seed(4)
    lens = [3, 70, 1]
    q, keys, values, offsets = _ragged(gen, lens, 2, 16, torch.float32, gap=5)
    keys[:5] = values[:5] = 1e4  # the junk before head 0 must not be read
    ours = ragged_decode_attention_triton(q, keys, values, offsets, torch.tensor(lens), 0.5, block_n=16)
    torch.testing.assert_close(ours, _per_head_attention(q, keys, values, offsets, lens, 0.5), **FP32_TOL)


@pytest.mark.filterwarnings("ignore:invalid value encountered in divide")  # the expected 0/0
def test_ragged_empty_head_is_nan_in_both():
    gen = torch.Generator().manual_seed(5)
    lens = [4, 0, 9]
    q, keys, values, offsets = _ragged(gen, lens, 2, 16, torch.float32)
    ours = ragged_decode_attention_triton(q, keys, values, offsets, lens, 0.5)
    ref = ragged_decode_attention_reference(q, keys, values, offsets, lens, 0.5)
    assert ours[1].isnan().all() and ref[1].isnan().all()
    torch.testing.assert_close(ours[[0, 2]], ref[[0, 2]], **FP32_TOL)


def test_ragged_reference_matches_per_head_softmax():
    gen = torch.Generator().manual_seed(6)
    lens = [1, 250, 33, 2, 100]
    q, keys, values, offsets = _ragged(gen, lens, 4, 32, torch.float32)
    torch.testing.assert_close(
        ragged_decode_attention_reference(q, keys, values, offsets, lens, 0.2),
        _per_head_attention(q, keys, values, offsets, lens, 0.2),
        **FP32_TOL,
    )


def test_ragged_dispatcher_matches_the_padded_sdpa_decode_path():
    # the call kvbench.attention._decode can make on a ragged KVLayer, vs the padded SDPA it does today
    gen = torch.Generator().manual_seed(8)
    lens, group, dim = [7, 1, 40], 4, 16
    layer = KVBenchCache(1).layers[0]
    layer.keys, layer.values = torch.randn(sum(lens), dim, generator=gen), torch.randn(sum(lens), dim, generator=gen)
    layer.positions = torch.arange(sum(lens), dtype=torch.int32)
    layer.head_lens = lens
    query = torch.randn(1, len(lens) * group, 1, dim, generator=gen)  # [1, H_q, 1, D] as transformers passes it
    q = query[0, :, 0, :].view(len(lens), group, dim)
    out = ragged_decode_attention(q, layer.keys, layer.values, layer._offsets(), layer.head_lens, 0.25)
    view = layer.head_view()
    sdpa = F.scaled_dot_product_attention(
        q[None], view.keys[None], view.values[None], attn_mask=view.valid[None, :, None, :], scale=0.25
    )
    torch.testing.assert_close(out.reshape(1, -1, 1, dim), sdpa.reshape(1, -1, 1, dim), **FP32_TOL)


def test_ragged_rejects_mismatched_shapes():
    q, keys = torch.randn(2, 4, 16), torch.randn(10, 16)
    with pytest.raises(ValueError, match="shape mismatch"):
        ragged_decode_attention_reference(q, keys, keys, torch.tensor([0, 5, 8]), [5, 3, 2], 0.5)


# -- dispatch -------------------------------------------------------------------------------------------


def test_dispatchers_pick_the_reference_on_cpu(monkeypatch):
    gen = torch.Generator().manual_seed(7)
    q, keys, values = (torch.randn(2, s, 16, generator=gen) for s in (4, 30, 30))
    idx = torch.randint(0, 30, (2, 4, 5), generator=gen)
    assert not use_triton(q, keys)
    assert torch.equal(topk_attention(q, keys, values, idx, 0.5), topk_attention_reference(q, keys, values, idx, 0.5))
    offsets, lens = torch.tensor([0, 10]), [10, 20]
    assert torch.equal(
        ragged_decode_attention(q, keys[0], values[0], offsets, lens, 0.5),
        ragged_decode_attention_reference(q, keys[0], values[0], offsets, lens, 0.5),
    )
    monkeypatch.setenv(ENV_VAR, "torch")
    assert not use_triton(q)
    monkeypatch.setenv(ENV_VAR, "trition")
    with pytest.raises(ValueError, match=ENV_VAR):
        use_triton(q)
