"""Triton kernels vs their PyTorch references (Triton interpreter on CPU), references vs dense oracles.

triton reads TRITON_INTERPRET once, when it is imported (its standard library, tl.sum, tl.max..., is
jitted then): conftest sets it before anything imports triton, and this module sets it too for
`--noconftest` runs. The Triton launchers are called directly: the dispatchers pick the references on CPU
tensors.

`KVBENCH_KERNEL_DEVICE=cuda TRITON_INTERPRET=0 pytest tests/test_kernels.py` runs the same tests with the
launchers compiled on a GPU: every Triton call gets its tensor arguments copied to the device with their
strides (views stay views: slices, transposes, expanded dimensions) and its results copied back, so the
kernels are compared with the same CPU references and oracles. `scripts/gpu_check_kernels.py` checks them
at decode-sized shapes.
"""

from __future__ import annotations

import functools
import os
import types

os.environ.setdefault("TRITON_INTERPRET", "1" if os.environ.get("KVBENCH_KERNEL_DEVICE", "cpu") == "cpu" else "0")

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from kvbench.cache.kvcache import KVBenchCache
from kvbench.kernels import (
    _distinct_rows_kernels,
    _flash_decode_kernels,
    _group_scores_kernels,
    _stable_topk_kernels,
    _triton_kernels,
    page_summary,
    ragged_attention,
    sparse_attention,
)
from kvbench.kernels._dispatch import ENV_VAR, use_triton
from kvbench.kernels.decode_attention import decode_attention
from kvbench.kernels.distinct_rows import distinct_rows, distinct_rows_reference
from kvbench.kernels.exact_scores import exact_logits
from kvbench.kernels.page_summary import (
    page_minmax,
    page_minmax_reference,
    page_scores,
    page_scores_reference,
    page_scores_traced,
)
from kvbench.kernels.ragged_attention import (
    ragged_decode_attention_reference,
)
from kvbench.kernels.reduced_scores import reduced_scores, reduced_scores_reference
from kvbench.kernels.sparse_attention import (
    topk_attention,
    topk_attention_reference,
    topk_attention_traced,
)

pytestmark = pytest.mark.kernels
DEVICE = os.environ.get("KVBENCH_KERNEL_DEVICE", "cpu")  # cpu: interpreted; cuda: compiled
if DEVICE != "cpu" and (not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")):
    pytest.skip(f"KVBENCH_KERNEL_DEVICE={DEVICE} needs a GPU and TRITON_INTERPRET=0", allow_module_level=True)


def _to(x, device):
    """x on device with x's strides and storage offset (a copy of its whole storage); non-tensors as they are."""
    if not isinstance(x, torch.Tensor):
        return x
    storage = x.untyped_storage()
    flat = torch.empty(0, dtype=x.dtype).set_(storage, 0, (storage.nbytes() // x.element_size(),))
    return flat.to(device).as_strided(x.shape, x.stride(), x.storage_offset())


def _on_device(launch):
    """`launch` itself on CPU (interpreted); with KVBENCH_KERNEL_DEVICE set, `launch` run there (compiled) on
    copies of its tensor arguments, its tensor results copied back to the CPU."""
    if DEVICE == "cpu":
        return launch

    @functools.wraps(launch)
    def run(*args, **kwargs):
        out = launch(*(_to(a, DEVICE) for a in args), **{k: _to(v, DEVICE) for k, v in kwargs.items()})
        return tuple(o.cpu() for o in out) if isinstance(out, tuple) else out.cpu()

    return run


topk_attention_triton = _on_device(sparse_attention.topk_attention_triton)
ragged_decode_attention_triton = _on_device(ragged_attention.ragged_decode_attention_triton)
launch_page_minmax = _on_device(_triton_kernels.launch_page_minmax)
page_scores_by_group_scores = _on_device(page_summary.page_scores_by_group_scores)
launch_group_scores = _on_device(_group_scores_kernels.launch_group_scores)

FP32_TOL = {"atol": 1e-5, "rtol": 1e-5}
# a bf16 output is the fp32 result cast once: within one ulp (2^-7 relative), not half of one, because the
# Triton interpreter truncates fp32 -> bf16 casts (compiled kernels round to nearest)
BF16_TOL = {"atol": 1e-6, "rtol": 2.0**-7 + 1e-5}
FP16_TOL = {"atol": 1e-6, "rtol": 2.0**-10 + 1e-5}  # the same bound at fp16's 10 mantissa bits
# fp32 scores (whatever the input dtype: fp16/bf16 widen exactly) summed over up to 32 O(1) products in another
# order than the reference's einsum/bmm: a few fp32 ulps of the sum of |products|
SCORE_TOL = {"atol": 5e-5, "rtol": 1e-5}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _close_to_fp32(out: torch.Tensor, exact: torch.Tensor) -> None:
    """`out` (in its own dtype) matches the fp32 result `exact` up to that dtype's output rounding."""
    tol = {torch.float32: FP32_TOL, torch.float16: FP16_TOL}.get(out.dtype, BF16_TOL)
    torch.testing.assert_close(out.float(), exact, **tol)


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
@pytest.mark.filterwarnings("ignore:divide by zero encountered in log2")  # the expected log2(0) = -inf
def test_topk_all_padding_selection_is_nan_in_both():
    q, keys, values = torch.randn(1, 2, 16), torch.randn(1, 10, 16), torch.randn(1, 10, 16)
    valid = torch.arange(10)[None, :] < 5
    idx = torch.tensor([[[5, 6, 7], [0, 8, 9]]])
    ours, ours_lse = topk_attention_triton(q, keys, values, idx, 0.25, valid, return_lse=True)
    ref, ref_lse = topk_attention_reference(q, keys, values, idx, 0.25, valid, return_lse=True)
    assert ours[0, 0].isnan().all() and ref[0, 0].isnan().all()
    # -inf, not NaN: merging it with another part gives that part weight exp(-inf - lse) = 0
    assert ours_lse[0, 0] == ref_lse[0, 0] == float("-inf")
    torch.testing.assert_close(ours[0, 1], ref[0, 1], **FP32_TOL)
    torch.testing.assert_close(ours_lse[0, 1], ref_lse[0, 1], **FP32_TOL)


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


def _distinct_idx(gen, n_kv, group, length, k):
    """[n_kv, group, k] indices, distinct within each query head's selection."""
    rows = [torch.randperm(length, generator=gen)[:k] for _ in range(n_kv * group)]
    return torch.stack(rows).view(n_kv, group, k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 4, 8])
def test_topk_lse_matches_logsumexp(group, dtype):
    n_kv, length, dim, k = 2, 70, 32, 19
    gen = torch.Generator().manual_seed(group)
    q = _randn(gen, n_kv, group, dim, dtype=dtype)
    keys = _randn(gen, n_kv, length, dim, dtype=dtype)
    values = _randn(gen, n_kv, length, dim, dtype=dtype)
    idx = torch.randint(0, length, (n_kv, group, k), generator=gen)  # repeats count repeatedly in the lse too
    valid = torch.arange(length)[None, :] < torch.tensor([length, 50])[:, None]
    valid[1, idx[1, :, 0]] = True  # every query head keeps a real token
    ours, ours_lse = topk_attention_triton(q, keys, values, idx, 0.3, valid, return_lse=True, block_k=8)
    ref, ref_lse = topk_attention_reference(q, keys, values, idx, 0.3, valid, return_lse=True)
    k_sel = keys.float()[torch.arange(n_kv)[:, None, None], idx]  # [H_kv, G, k, D]
    logits = torch.einsum("hgd,hgkd->hgk", q.float(), k_sel) * 0.3
    logits.masked_fill_(~valid[torch.arange(n_kv)[:, None, None], idx], float("-inf"))
    exact_lse = torch.logsumexp(logits, -1)
    assert ours_lse.dtype == ref_lse.dtype == torch.float32 and ours_lse.shape == (n_kv, group)
    torch.testing.assert_close(ours_lse, exact_lse, **FP32_TOL)
    torch.testing.assert_close(ref_lse, exact_lse, **FP32_TOL)
    # asking for the lse leaves the output as it was
    torch.testing.assert_close(ours, topk_attention_triton(q, keys, values, idx, 0.3, valid, block_k=8), atol=0, rtol=0)
    exact = topk_attention_reference(q.float(), keys.float(), values.float(), idx, 0.3, valid)
    _close_to_fp32(ours, exact)
    _close_to_fp32(ref, exact)


@pytest.mark.parametrize("impl", ["triton", "reference"])
@pytest.mark.parametrize("masked", [False, True])
def test_topk_lse_merges_disjoint_halves_exactly(impl, masked):
    n_kv, group, length, dim, k = 2, 4, 64, 16, 30
    gen = torch.Generator().manual_seed(9)
    q, keys, values = (torch.randn(n_kv, s, dim, generator=gen) for s in (group, length, length))
    idx = _distinct_idx(gen, n_kv, group, length, k)
    valid = None
    if masked:
        valid = torch.rand(n_kv, length, generator=gen) < 0.6
        # each half keeps a real token: a half that is all padding has NaN out, which no weight of 0 cancels
        valid.scatter_(1, idx[:, :, 0], True)
        valid.scatter_(1, idx[:, :, k // 2], True)
    if impl == "triton":
        def attend(i):
            return topk_attention_triton(q, keys, values, i, 0.4, valid, return_lse=True, block_k=4)
    else:
        def attend(i):
            return topk_attention_reference(q, keys, values, i, 0.4, valid, return_lse=True)
    out1, lse1 = attend(idx[..., : k // 2])
    out2, lse2 = attend(idx[..., k // 2 :])
    whole, whole_lse = attend(idx)
    lse = torch.logaddexp(lse1, lse2)
    merged = (lse1 - lse).exp()[..., None] * out1 + (lse2 - lse).exp()[..., None] * out2
    torch.testing.assert_close(lse, whole_lse, **FP32_TOL)
    torch.testing.assert_close(merged, whole, **FP32_TOL)


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
    "lens, group, dim, block_n, rows_per_split",
    [
        ([1, 300, 17, 64], 4, 64, 32, 512),  # lengths 1 .. 300, partial and exact blocks, one split
        ([1, 300, 17, 64], 4, 64, 32, 64),  # split-K: 5 runs of rows, most heads done after the first
        ([5, 1, 129], 1, 16, 64, 16),  # rows_per_split below block_n: rounded up to one block
        ([300, 2], 4, 80, 16, 48),  # head dim not a power of two, runs of 3 blocks
    ],
)
def test_ragged_triton_matches_reference(lens, group, dim, block_n, rows_per_split, dtype):
    gen = torch.Generator().manual_seed(sum(lens))
    q, keys, values, offsets = _ragged(gen, lens, group, dim, dtype)
    ours = ragged_decode_attention_triton(q, keys, values, offsets, lens, 0.3, block_n=block_n,
                                          rows_per_split=rows_per_split)
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
    # the call kvbench.attention._decode makes on a ragged KVLayer whose heads have append slack between them
    gen = torch.Generator().manual_seed(8)
    lens, group, dim = [7, 1, 40], 4, 16
    layer = KVBenchCache(1).layers[0]
    layer.head_dim = dim
    layer._install({"keys": torch.randn(sum(lens), dim, generator=gen),
                    "values": torch.randn(sum(lens), dim, generator=gen),
                    "positions": torch.arange(sum(lens), dtype=torch.int32)}, lens, slack=5)
    assert layer.keys.shape == (sum(lens) + 5 * len(lens), dim) and layer.starts == [0, 12, 18]
    query = torch.randn(1, len(lens) * group, 1, dim, generator=gen)  # [1, H_q, 1, D] as transformers passes it
    q = query[0, :, 0, :].view(len(lens), group, dim)
    view = layer.head_view()
    sdpa = F.scaled_dot_product_attention(
        q[None], view.keys[None], view.values[None], attn_mask=view.valid[None, :, None, :], scale=0.25
    )
    reference = ragged_decode_attention_reference(q, layer.keys, layer.values, layer._offsets(), lens, 0.25)
    for name in ("keys", "values"):  # slack rows: the decode path must never read them
        layer.buffers[name][torch.tensor([7, 8, 13, 58])] = float("nan")
    out = decode_attention(q, layer.buffers["keys"], layer.buffers["values"], 0.25, layer.starts, layer.lens, layer.caps)
    torch.testing.assert_close(out.reshape(1, -1, 1, dim), sdpa.reshape(1, -1, 1, dim), **FP32_TOL)
    torch.testing.assert_close(out, reference, **FP32_TOL)


def test_ragged_rejects_mismatched_shapes():
    q, keys = torch.randn(2, 4, 16), torch.randn(10, 16)
    with pytest.raises(ValueError, match="shape mismatch"):
        ragged_decode_attention_reference(q, keys, keys, torch.tensor([0, 5, 8]), [5, 3, 2], 0.5)


# -- page summaries (Quest, HSA) ------------------------------------------------------------------------


def _page_loop(keys, page_size):
    """Oracle: each page's min and max by slicing, one page at a time."""
    heads, n, dim = keys.shape
    pages = [keys[:, start : start + page_size] for start in range(0, n, page_size)]
    if not pages:
        return keys.new_empty(heads, 0, dim), keys.new_empty(heads, 0, dim)
    return torch.stack([p.amin(1) for p in pages], 1), torch.stack([p.amax(1) for p in pages], 1)


# (N, page size): partial last pages, N = 1, N < page, N a multiple of the page, and a page (40) that the
# kernel reads in three chunks of 16 rows, the last one straddling the next page
PAGE_CASES = [(70, 16), (1, 16), (5, 16), (48, 16), (33, 1), (67, 2), (64, 3), (70, 40)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, page_size", PAGE_CASES)
def test_page_minmax_triton_matches_reference(n, page_size, dtype):
    gen = torch.Generator().manual_seed(n * 100 + page_size)
    keys = _randn(gen, 2, n, 24, dtype=dtype)  # D = 24: masked lanes
    kmin, kmax = launch_page_minmax(keys, page_size)
    ref_min, ref_max = page_minmax_reference(keys, page_size)
    assert kmin.dtype == kmax.dtype == dtype and kmin.shape == kmax.shape == (2, -(-n // page_size), 24)
    # a min or a max is one of its inputs: exact in every dtype
    assert torch.equal(kmin, ref_min) and torch.equal(kmax, ref_max)


def test_page_minmax_triton_strided_and_empty():
    gen = torch.Generator().manual_seed(10)
    # keys as the transpose of a [H, D, N] tensor: rows are not contiguous
    keys = torch.randn(2, 16, 45, generator=gen).transpose(1, 2)
    for got, want in zip(launch_page_minmax(keys, 8), _page_loop(keys, 8)):
        assert torch.equal(got, want)
    kmin, kmax = launch_page_minmax(keys[:, :0], 8)
    assert kmin.shape == kmax.shape == (2, 0, 16)


@pytest.mark.parametrize("page_size", [1, 2, 3, 16])
@pytest.mark.parametrize("n", [0, 1, 37])
def test_page_minmax_reference_matches_page_loop(n, page_size):
    keys = torch.randn(2, n, 8, generator=torch.Generator().manual_seed(n + page_size))
    for got, want in zip(page_minmax_reference(keys, page_size), _page_loop(keys, page_size)):
        assert torch.equal(got, want)


def _page_score_inputs(gen, group, n, dim, page_size, k1, shared_sign, dtype):
    """q, page summaries, k1 dims per KV head (all of them in random order when k1 = D) and signs."""
    heads = 2
    q = _randn(gen, heads, group, dim, dtype=dtype)
    kmin, kmax = page_minmax_reference(_randn(gen, heads, n, dim, dtype=dtype), page_size)
    if k1 == dim:
        dims = torch.stack([torch.randperm(dim, generator=gen) for _ in range(heads)])
    else:  # HSA's choice: the dimensions of largest group |q|
        dims = q.float().abs().sum(1).topk(k1, dim=-1).indices
    q_sel = q.float().gather(2, dims[:, None, :].expand(heads, group, k1))
    positive = q_sel.sum(1, keepdim=True) > 0 if shared_sign else q_sel > 0
    return q, kmin, kmax, dims, positive


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "group, n, page_size, k1, shared_sign",
    [
        (1, 70, 16, 32, False),  # Quest: all dims, own signs, partial last page
        (4, 67, 2, 1, True),  # one dim, group-shared signs ([H, 1, k1])
        (8, 300, 3, 5, True),  # HSA-like, G = 8, pages over several programs of the operator
        (4, 1, 1, 32, False),  # a single page of a single token
        (8, 33, 1, 32, True),  # page size 1: the bound is q . k itself
    ],
)
def test_page_scores_by_group_scores_matches_reference(group, n, page_size, k1, shared_sign, dtype):
    """The two group-scores products (CUDA's page scores, eager and compiled) give the reference's bounds."""
    gen = torch.Generator().manual_seed(group * 1000 + n)
    q, kmin, kmax, dims, positive = _page_score_inputs(gen, group, n, 32, page_size, k1, shared_sign, dtype)
    ours = page_scores_by_group_scores(q, kmin, kmax, dims, positive)
    ref = page_scores_reference(q, kmin, kmax, dims, positive)
    assert ours.dtype == ref.dtype == torch.float32 and ours.shape == ref.shape == (2, group, kmin.shape[1])
    torch.testing.assert_close(ours, ref, **SCORE_TOL)
    if k1 == 32:  # every dimension: dims None, each query head's own signs
        torch.testing.assert_close(page_scores_by_group_scores(q, kmin, kmax, None, q > 0),
                                   page_scores_reference(q, kmin, kmax, None, q > 0), **SCORE_TOL)


@pytest.mark.parametrize("dtype", DTYPES)
def test_page_scores_over_every_dimension_without_dims(dtype):
    """dims=None (Quest: every dimension in order) is bitwise the identity gather, in both implementations."""
    gen = torch.Generator().manual_seed(5)
    q = _randn(gen, 2, 4, 32, dtype=dtype)
    kmin, kmax = page_minmax_reference(_randn(gen, 2, 70, 32, dtype=dtype), 16)
    every = torch.arange(32).expand(2, 32)
    want = page_scores_reference(q, kmin, kmax, every, q > 0)
    assert torch.equal(page_scores_reference(q, kmin, kmax, None, q > 0), want)
    torch.testing.assert_close(page_scores(q, kmin, kmax, None, q > 0), want, **SCORE_TOL)


def test_topk_attention_reference_is_bitwise_its_einsum_definition():
    """Its bmm products are the ones einsum runs, for a per-head and a group-shared selection alike."""
    for seed in range(30):
        gen = torch.Generator().manual_seed(seed)
        n_kv, group, dim, length, k = 1 + seed % 4, 1 + seed % 6, 16 * (1 + seed % 4), 200, 1 + 7 * seed
        q, keys, values = (torch.randn(n_kv, rows, dim, generator=gen) for rows in (group, length, length))
        per_head = torch.randint(0, length, (n_kv, group, k), generator=gen)
        for idx in (per_head, per_head[:, :1].expand(n_kv, group, k)):
            k_sel, v_sel = (t[torch.arange(n_kv)[:, None, None], idx] for t in (keys, values))
            probs = torch.softmax(torch.einsum("hgd,hgkd->hgk", q, k_sel) * 0.3, dim=-1)
            assert torch.equal(topk_attention_reference(q, keys, values, idx, 0.3),
                               torch.einsum("hgk,hgkd->hgd", probs, v_sel))


def test_page_scores_reference_is_bitwise_its_einsum_definition():
    """The reference's bmm products are the ones einsum runs: stored float32 Quest and RocketKV records hold."""
    for seed in range(40):
        gen = torch.Generator().manual_seed(seed)
        heads, group, dim, pages = 1 + seed % 4, 1 + seed % 5, 16 * (1 + seed % 4), 1 + 37 * seed
        q = torch.randn(heads, group, dim, generator=gen)
        spare = torch.randn(2, heads, pages + seed % 3, dim, generator=gen)
        kmin, kmax = spare[0, :, :pages], spare[1, :, :pages]  # views with spare pages, as `PageSummary` holds
        dims = torch.stack([torch.randperm(dim, generator=gen)[: dim // 2] for _ in range(heads)])
        for chosen in (None, dims):
            k = dim if chosen is None else dims.shape[1]
            pick = (lambda t: t) if chosen is None else (lambda t: t.gather(2, dims[:, None].expand(heads, t.shape[1], k)))
            q_sel, lo, hi = pick(q), pick(kmin), pick(kmax)
            pos = torch.rand(heads, group, k, generator=gen) > 0.5
            want = torch.einsum("hgk,hpk->hgp", q_sel * pos, hi) + torch.einsum("hgk,hpk->hgp", q_sel * ~pos, lo)
            assert torch.equal(page_scores_reference(q, kmin, kmax, chosen, pos), want)


def test_page_scores_by_group_scores_strided_inputs():
    # summaries (their transposes, the operator's keys) and q as views with odd strides, positive already expanded
    # over the group (stride 0)
    gen = torch.Generator().manual_seed(11)
    wide = torch.randn(2, 9, 40, generator=gen)
    kmin, kmax = wide[..., :16], wide[..., 20:36]  # [H, P=9, D=16]
    q = torch.randn(4, 2, 16, generator=gen).transpose(0, 1)  # [H, G, D], not contiguous
    dims = torch.stack([torch.randperm(16, generator=gen)[:6] for _ in range(2)])
    positive = (torch.rand(2, 1, 6, generator=gen) > 0.5).expand(2, 4, 6)
    torch.testing.assert_close(
        page_scores_by_group_scores(q, kmin, kmax, dims, positive),
        page_scores_reference(q, kmin, kmax, dims, positive),
        **SCORE_TOL,
    )


def test_page_scores_reference_matches_its_formula():
    gen = torch.Generator().manual_seed(12)
    heads, group, dim, k1 = 2, 3, 8, 4
    q, kmin, kmax, dims, positive = _page_score_inputs(gen, group, 20, dim, 3, k1, False, torch.float32)
    positive[0, 1] = ~positive[0, 1]  # signs need not follow q's
    out = page_scores_reference(q, kmin, kmax, dims, positive)
    for h in range(heads):
        for g in range(group):
            for p in range(kmin.shape[1]):
                want = sum(
                    float(q[h, g, dims[h, j]]) * float((kmax if positive[h, g, j] else kmin)[h, p, dims[h, j]])
                    for j in range(k1)
                )
                assert out[h, g, p].item() == pytest.approx(want, rel=1e-5, abs=1e-5)
    # a group-shared sign pattern is the same as repeating it over the group
    shared = positive[:, :1]
    torch.testing.assert_close(
        page_scores_reference(q, kmin, kmax, dims, shared),
        page_scores_reference(q, kmin, kmax, dims, shared.expand(heads, group, k1).clone()),
        atol=0, rtol=0,
    )


@pytest.mark.parametrize("page_size", [1, 2, 3, 16])
def test_page_scores_reference_bounds_every_key(page_size):
    # Quest's bound: with all dims and each query head's own signs, no key of a page scores above its bound
    heads, n, dim = 2, 37, 32
    gen = torch.Generator().manual_seed(page_size)
    q, keys = torch.randn(heads, 1, dim, generator=gen), torch.randn(heads, n, dim, generator=gen)
    kmin, kmax = page_minmax_reference(keys, page_size)
    dims = torch.arange(dim).expand(heads, dim)
    bound = page_scores_reference(q, kmin, kmax, dims, q > 0)[:, 0].double()  # [H, P]
    logits = torch.einsum("hd,hnd->hn", q[:, 0].double(), keys.double())
    for p in range(kmin.shape[1]):
        page_max = logits[:, p * page_size : (p + 1) * page_size].amax(1)
        assert (bound[:, p] >= page_max - 1e-5).all()
        if page_size == 1:  # a one-token page's bound is that token's logit
            torch.testing.assert_close(bound[:, p], page_max, atol=1e-5, rtol=1e-5)


# -- a KV group's logits over all or chosen head dimensions (kvbench::group_scores: SparQ, Exact-TopK) -------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "group, n, r, block_n",
    [
        (1, 1, 1, 128),   # one token, one dim (padded to a 16-wide product)
        (4, 70, 32, 16),  # every dim (r = D), five token blocks, the last partial
        (8, 33, 5, 128),  # r below the product's 16
        (3, 40, None, 16),  # every dim without an index (Exact-TopK's exact logits), a group of 3
    ],
)
def test_group_scores_triton_matches_reference(group, n, r, block_n, dtype):
    gen = torch.Generator().manual_seed(group * 100 + n + (r or 0))
    heads, dim = 2, 32
    q = _randn(gen, heads, group, dim, dtype=dtype)
    keys_t = _randn(gen, heads, dim, n, dtype=dtype)
    if r is None:
        ours = launch_group_scores(q, keys_t, None, block_n=block_n)
        ref = exact_logits(q, keys_t.transpose(1, 2))  # the CPU reference
    else:
        dims = torch.stack([torch.randperm(dim, generator=gen)[:r] for _ in range(heads)])
        ours = launch_group_scores(q, keys_t, dims, block_n=block_n)
        ref = reduced_scores_reference(q, keys_t, dims)
    assert ours.dtype == ref.dtype == torch.float32 and ours.shape == ref.shape == (heads, group, n)
    torch.testing.assert_close(ours, ref, **SCORE_TOL)


def test_group_scores_triton_strided_and_empty():
    gen = torch.Generator().manual_seed(13)
    keys_t = torch.randn(2, 45, 16, generator=gen).transpose(1, 2)  # [H, D, N] with N not contiguous
    q = torch.randn(4, 2, 16, generator=gen).transpose(0, 1)
    dims = torch.randint(0, 16, (2, 3), generator=gen)  # a repeated dim counts twice, as in the reference
    torch.testing.assert_close(
        launch_group_scores(q, keys_t, dims, block_n=16), reduced_scores_reference(q, keys_t, dims), **SCORE_TOL
    )
    # the keys as the static layout holds them ([H, L, D] rows of a flat buffer), transposed by a view
    keys = torch.randn(2 * 50, 16, generator=gen)
    by_head = keys.view(2, 50, 16)[:, :45]
    torch.testing.assert_close(launch_group_scores(q, by_head.transpose(1, 2), None, block_n=32),
                               exact_logits(q, by_head), **SCORE_TOL)
    assert launch_group_scores(q, keys_t[..., :0], dims).shape == (2, 4, 0)


@pytest.mark.skipif(DEVICE != "cpu", reason="traces the operator on CPU tensors (interpreted launch)")
def test_group_scores_is_one_operator_in_a_compiled_graph_where_it_applies(monkeypatch):
    """On CUDA (here: the rule forced, the launch interpreted) SparQ's reduced scores and Exact-TopK's exact logits
    are the operator, eager and compiled alike, equal to the references; on the CPU the references, traced."""
    import kvbench.kernels.group_scores as group_scores_module
    from kvbench.kernels.reduced_scores import reduced_scores as dispatched

    gen = torch.Generator().manual_seed(21)
    q, keys = torch.randn(2, 4, 32, generator=gen), torch.randn(2, 60, 32, generator=gen)
    keys_t = keys.transpose(1, 2).contiguous()
    dims = torch.randint(0, 32, (2, 4), generator=gen)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def traced(fn, *args):
        graphs.clear()
        torch._dynamo.reset()
        out = torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)(*args)
        return out, {n.target for g in graphs for n in g.graph.nodes if n.op == "call_function"}

    kernel = {torch.ops.kvbench.group_scores, torch.ops.kvbench.group_scores.default}
    cpu = [traced(exact_logits, q, keys), traced(dispatched, q, keys_t, dims)]
    assert not any(ops & kernel for _, ops in cpu)
    monkeypatch.setattr(group_scores_module, "triton_launchable", lambda *tensors: True)  # as on CUDA
    monkeypatch.setattr(group_scores_module.FALLBACK, "failed", [])
    for (want, _), fn, args in zip(cpu, (exact_logits, dispatched), ((q, keys), (q, keys_t, dims))):
        out, ops = traced(fn, *args)
        assert ops & kernel and not group_scores_module.FALLBACK.failed
        torch.testing.assert_close(out, want, **SCORE_TOL)
        torch.testing.assert_close(fn(*args), want, **SCORE_TOL)  # eager: the operator too


def test_reduced_scores_reference_is_a_masked_dot_product():
    gen = torch.Generator().manual_seed(14)
    heads, group, dim, n, r = 2, 4, 16, 30, 5
    q, keys = torch.randn(heads, group, dim, generator=gen), torch.randn(heads, n, dim, generator=gen)
    dims = torch.stack([torch.randperm(dim, generator=gen)[:r] for _ in range(heads)])
    mask = torch.zeros(heads, 1, dim).scatter_(2, dims[:, None, :], 1.0)
    exact = torch.einsum("hgd,hnd->hgn", (q * mask).double(), keys.double()).float()
    torch.testing.assert_close(reduced_scores_reference(q, keys.transpose(1, 2), dims), exact, **SCORE_TOL)
    # with every dimension, the scores are the full logits
    all_dims = torch.arange(dim).expand(heads, dim)
    full = torch.einsum("hgd,hnd->hgn", q.double(), keys.double()).float()
    torch.testing.assert_close(reduced_scores_reference(q, keys.transpose(1, 2), all_dims), full, **SCORE_TOL)


# -- dispatch -------------------------------------------------------------------------------------------


def test_dispatchers_pick_pytorch_on_cpu(monkeypatch):
    gen = torch.Generator().manual_seed(7)
    q, keys, values = (torch.randn(2, s, 16, generator=gen) for s in (4, 30, 30))
    idx = torch.randint(0, 30, (2, 4, 5), generator=gen)
    assert not use_triton(q, keys)
    assert torch.equal(topk_attention(q, keys, values, idx, 0.5), topk_attention_reference(q, keys, values, idx, 0.5))
    per_head = torch.stack([  # ragged decode on CPU in float32: one stock SDPA call per head's segment
        F.scaled_dot_product_attention(q[h][None, :, None], keys[0, s:s + n][None, None], values[0, s:s + n][None, None],
                                       scale=0.5, enable_gqa=True)[0, :, 0] for h, (s, n) in enumerate([(0, 10), (10, 20)])])
    assert torch.equal(decode_attention(q, keys[0], values[0], 0.5, [0, 10], [10, 20], [10, 20]), per_head)
    out, lse = topk_attention(q, keys, values, idx, 0.5, return_lse=True)
    ref, ref_lse = topk_attention_reference(q, keys, values, idx, 0.5, return_lse=True)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    kmin, kmax = page_minmax(keys, 4)
    assert all(torch.equal(a, b) for a, b in zip((kmin, kmax), page_minmax_reference(keys, 4)))
    dims = torch.randint(0, 16, (2, 3), generator=gen)
    positive = torch.rand(2, 4, 3, generator=gen) > 0.5
    assert torch.equal(
        page_scores(q, kmin, kmax, dims, positive), page_scores_reference(q, kmin, kmax, dims, positive)
    )
    keys_t = keys.transpose(1, 2)
    assert torch.equal(reduced_scores(q, keys_t, dims), reduced_scores_reference(q, keys_t, dims))
    monkeypatch.setenv(ENV_VAR, "torch")
    assert not use_triton(q)
    monkeypatch.setenv(ENV_VAR, "trition")
    with pytest.raises(ValueError, match=ENV_VAR):
        use_triton(q)


# -- the compiled decode step's formulations (inductor) ----------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group, shared, masked", [(4, True, False), (4, True, True), (4, False, True), (1, True, True)])
def test_topk_attention_traced_is_the_reference(group, shared, masked, dtype):
    """The compiled step's top-k attention (one product per KV head over the group, when the group shares its
    selection) computes the reference's function, with its log-sum-exp, inside and outside torch.compile."""
    gen = torch.Generator().manual_seed(group * 10 + shared + 2 * masked)
    n_kv, length, dim, k = 2, 90, 16, 24
    q = _randn(gen, n_kv, group, dim, dtype=dtype)
    keys, values = _randn(gen, n_kv, length, dim, dtype=dtype), _randn(gen, n_kv, length, dim, dtype=dtype)
    if shared:
        idx = torch.stack([torch.randperm(length, generator=gen)[:k] for _ in range(n_kv)])[:, None].expand(n_kv, group, k)
    else:
        idx = torch.randint(0, length, (n_kv, group, k), generator=gen)
    valid = torch.rand(n_kv, length, generator=gen) > 0.2 if masked else None
    want, want_lse = topk_attention_reference(q, keys, values, idx, 0.3, valid, return_lse=True)
    traced = functools.partial(topk_attention_traced, scaling=0.3, valid=valid, return_lse=True)
    for fn in (traced, torch.compile(traced, backend="eager", fullgraph=True)):
        out, lse = fn(q, keys, values, idx)
        assert out.dtype == dtype and out.shape == want.shape
        _close_to_fp32(out, want.float())
        torch.testing.assert_close(lse, want_lse, **SCORE_TOL)


def _own_code(fn):
    """`fn` with a code object of its own: dynamo keeps compiled graphs per code object, so each test's graphs
    stay apart and count against no other test's recompile limit (on every torch: `isolate_recompiles` is 2.12's)."""
    _own_code.count = getattr(_own_code, "count", 0) + 1
    code = fn.__code__.replace(co_name=f"{fn.__code__.co_name}_{_own_code.count}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 3, 8])
def test_exact_logits_traced_is_the_reference(group, dtype):
    """The compiled step's exact logits (one reduction per query head, keys read in their own dtype) are the
    float32 product's, up to the order of the sums, and the rotary-free query it reads is the one passed."""
    gen = torch.Generator().manual_seed(group)
    q, keys = _randn(gen, 3, group, 32, dtype=dtype), _randn(gen, 3, 75, 32, dtype=dtype)
    want = torch.einsum("hgd,hld->hgl", q.float(), keys.float())
    assert torch.equal(exact_logits(q, keys), want)  # eager: the reference itself
    traced = torch.compile(_own_code(exact_logits), backend="eager", fullgraph=True)(q, keys)
    assert traced.dtype == torch.float32 and traced.shape == want.shape
    torch.testing.assert_close(traced, want, **SCORE_TOL)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_distinct_rows_counts_each_row_once_inside_and_outside_compile(backend):
    """Distinct values per row, summed: repeated indices (a per-query-head selection that shares tokens, a
    selection padded with one slot) count once, eagerly and as the compiled step's opaque op."""
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 40, (3, 96), generator=gen)
    idx[1] = 7  # one slot, 96 times
    want = sum(len(set(row.tolist())) for row in idx)
    assert int(distinct_rows(idx, 40)) == want
    compiled = torch.compile(_own_code(lambda i: distinct_rows(i, 40) * 2), backend=backend, fullgraph=True)
    assert int(compiled(idx)) == 2 * want


launch_distinct_rows = _on_device(_distinct_rows_kernels.launch_distinct_rows)


@pytest.mark.parametrize("rows, m, length", [(3, 96, 40), (2, 3000, 5000), (4, 4096, 40960), (1, 1, 1), (2, 70, 64)])
def test_distinct_rows_triton_is_the_reference(rows, m, length):
    """The bitmap kernel counts what the mask counts: slots repeated within a program and across programs (m
    over one program's 1,024), a length that is not a multiple of 64, a row of one slot, strided indices."""
    gen = torch.Generator().manual_seed(m)
    idx = torch.randint(0, length, (rows, m), generator=gen)
    idx[0, : m // 2] = length - 1  # one slot, half the row
    want = distinct_rows_reference(idx, length)
    got = launch_distinct_rows(idx, length)
    assert got.shape == () and got.dtype == torch.int64 and int(got) == int(want)
    assert int(launch_distinct_rows(idx.t().contiguous().t(), length)) == int(want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group, k1, shared_sign", [(4, 5, True), (1, 32, False), (8, 1, True), (4, None, False)])
def test_page_scores_traced_is_the_reference(group, k1, shared_sign, dtype):
    """Zeroing the query outside the chosen dimensions gives the gathered bounds' scores, and every dimension
    (Quest's: dims None, each query head's own signs) the reference's, up to float rounding."""
    gen = torch.Generator().manual_seed(group + (k1 or 0))
    q, kmin, kmax, dims, positive = _page_score_inputs(gen, group, 67, 32, 3, k1 or 32, shared_sign, dtype)
    if k1 is None:
        dims, positive = None, q > 0
    torch.testing.assert_close(page_scores_traced(q, kmin, kmax, dims, positive),
                               page_scores_reference(q, kmin, kmax, dims, positive), **SCORE_TOL)


# -- split-K decode attention over the static layout (kvbench::flash_decode) ------------------------------

launch_flash_decode = _on_device(_flash_decode_kernels.launch_flash_decode)


def _static_layer(gen, fills, caps, group, dim, dtype, gap=0):
    """Flat static buffers: head h at `starts[h]`, `caps[h]` rows of room, its first `fills[h]` held; every row
    past a head's fill is NaN (a kernel that reads one poisons that head's output)."""
    starts = torch.tensor([sum(caps[:h]) + gap * h for h in range(len(caps))])
    total = sum(caps) + gap * len(caps)
    keys = torch.full((total, dim), float("nan")).to(dtype)
    values = torch.full((total, dim), float("nan")).to(dtype)
    for h, (s, n) in enumerate(zip(starts.tolist(), fills)):
        keys[s:s + n] = _randn(gen, n, dim, dtype=dtype)
        values[s:s + n] = _randn(gen, n, dim, dtype=dtype)
    return _randn(gen, len(fills), group, dim, dtype=dtype), keys, values, starts, torch.tensor(fills)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "fills, caps, group, dim, splits, block_n",
    [
        ([300, 300], [320, 320], 4, 64, 1, 64),  # uniform, one split, a partial last block
        ([300, 300], [320, 320], 4, 64, 5, 16),  # uniform, split-K: runs of 64 rows
        ([1, 129, 17, 64], [130, 130, 130, 130], 8, 16, 3, 16),  # GQA 8, lengths 1 .. 129 in a uniform capacity
        ([7, 1, 200], [9, 70, 300], 1, 80, 4, 32),  # ragged, MHA, head dim not a power of two
        ([5, 250], [256, 256], 4, 64, 64, 16),  # more splits than any head has rows for
        ([600, 3, 20], [640, 8, 32], 4, 16, 2, 16),  # a ragged long head: 600 rows in 2 splits of 80-row runs
    ],
)
def test_flash_decode_reads_each_heads_held_rows(fills, caps, group, dim, splits, block_n, dtype):
    gen = torch.Generator().manual_seed(sum(fills) + group)
    q, keys, values, starts, fill = _static_layer(gen, fills, caps, group, dim, dtype, gap=3)
    # the runs are sized by the average rows per head, as the operator sizes them
    out = launch_flash_decode(q, keys, values, starts, fill, 0.3, keys.shape[0] // len(fills), splits, block_n)
    assert out.dtype == dtype and out.shape == q.shape
    exact = _per_head_attention(q.float(), keys.float(), values.float(), starts, fills, 0.3)
    _close_to_fp32(out, exact)


def test_flash_decode_empty_head_is_nan_and_the_others_are_not():
    gen = torch.Generator().manual_seed(5)
    q, keys, values, starts, fill = _static_layer(gen, [0, 40, 3], [64, 64, 64], 4, 16, torch.float32)
    out = launch_flash_decode(q, keys, values, starts, fill, 0.3, 64, 2, 16)
    assert torch.isnan(out[0]).all() and torch.isfinite(out[1:]).all()
    _close_to_fp32(out[1:], _per_head_attention(q, keys, values, starts, [0, 40, 3], 0.3)[1:])


def test_flash_decode_strided_query():
    gen = torch.Generator().manual_seed(6)
    q, keys, values, starts, fill = _static_layer(gen, [33, 90], [96, 96], 4, 16, torch.float32)
    q_t = q.transpose(0, 1).contiguous().transpose(0, 1)  # same values, other strides
    assert q_t.stride() != q.stride()
    out = launch_flash_decode(q_t, keys, values, starts, fill, 0.3, 96, 2, 16)
    _close_to_fp32(out, _per_head_attention(q, keys, values, starts, [33, 90], 0.3))


def test_flash_decode_split_count_depends_on_static_shapes_alone():
    from kvbench.kernels.flash_decode import MIN_SPLIT_ROWS, split_count

    cpu = torch.device("cpu")  # rows per head of the buffer, KV heads, device
    assert split_count(1, 8, cpu) == 1 and split_count(MIN_SPLIT_ROWS + 1, 8, cpu) == 2
    many = [split_count(c, 8, cpu) for c in (32768, 131072, 1 << 20)]
    assert many[0] == many[1] == many[2] and many[0] * 8 >= 132  # every SM of a GPU busy at long contexts
    assert split_count(131072, 32, cpu) < split_count(131072, 8, cpu)  # more heads, fewer splits each


def _selected_slots(gen, fills, caps, rows, k):
    """[rows, k] slots per program row: mostly held slots, some past the head's fill (padding a selection may
    carry: no weight), repeats allowed (they count repeatedly)."""
    return torch.stack([torch.randint(0, max(1, min(cap, fill + 3)), (k,), generator=gen)
                        for fill, cap in zip(fills, caps)])[:rows]


def _selected_oracle(q, keys, values, starts, fills, caps, idx, scaling):
    """The reference over the [H, width] view the selection methods see (`topk_attention_reference` with the
    static layout's `valid`), in fp32; the rows past a head's fill zeroed first (a masked logit's NaN value
    would poison the reference's product, not the kernel, which never loads it)."""
    width = max(caps)
    slots = torch.arange(width)
    rows = (starts[:, None] + slots[None, :]).clamp(max=keys.shape[0] - 1)
    valid = slots[None, :] < torch.tensor(fills)[:, None]
    view_k, view_v = (t.nan_to_num().float()[rows] for t in (keys, values))
    return topk_attention_reference(q.float(), view_k, view_v, idx, scaling, valid)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "fills, caps, group, dim, k, splits, block_n",
    [
        ([300, 300], [320, 320], 4, 64, 37, 1, 16),  # uniform, k spanning three blocks, the last partial
        ([300, 250], [320, 320], 4, 64, 200, 3, 16),  # split-K over the selected slots
        ([1, 129, 17, 64], [130, 130, 130, 130], 8, 16, 24, 2, 16),  # GQA 8; head 0 holds one row
        ([7, 1, 200], [9, 70, 300], 1, 80, 5, 4, 32),  # ragged, MHA, head dim not a power of two
    ],
)
def test_flash_decode_reads_a_groups_selected_slots(fills, caps, group, dim, k, splits, block_n, dtype):
    """Indexed (`idx`): program h reads head h's selected slots, once for its group's query heads; slots past
    the fill are no row. The same function as the selection methods' reference over the layer's view."""
    gen = torch.Generator().manual_seed(sum(fills) + k)
    q, keys, values, starts, fill = _static_layer(gen, fills, caps, group, dim, dtype, gap=2)
    idx = _selected_slots(gen, fills, caps, len(fills), k)
    out = launch_flash_decode(q, keys, values, starts, fill, 0.3, k, splits, block_n, idx)
    assert out.dtype == dtype and out.shape == q.shape
    shared = idx[:, None, :].expand(-1, group, -1)
    _close_to_fp32(out, _selected_oracle(q, keys, values, starts, fills, caps, shared, 0.3))


def test_flash_decode_selection_over_padding_alone_is_nan():
    gen = torch.Generator().manual_seed(9)
    q, keys, values, starts, fill = _static_layer(gen, [5, 40], [64, 64], 4, 16, torch.float32)
    idx = torch.tensor([[10, 11, 12, 60], [0, 1, 39, 2]])  # head 0 selected only slots past its 5 rows
    out = launch_flash_decode(q, keys, values, starts, fill, 0.3, 4, 2, 16, idx)
    assert torch.isnan(out[0]).all() and torch.isfinite(out[1]).all()


@pytest.mark.skipif(DEVICE != "cpu", reason="calls the operator on CPU tensors (interpreted launch)")
@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flash_decode_selected_is_the_selection_methods_reference(shared, dtype):
    """`flash_decode_selected` on [H_kv, G, k] selections: shared by the group (expanded, stride 0: one program
    row per KV group) or per query head (one program row per query head), ragged heads."""
    from kvbench.kernels.flash_decode import flash_decode_selected

    gen = torch.Generator().manual_seed(10 + shared)
    fills, caps, group, k = [30, 3, 90], [40, 8, 128], 4, 11
    q, keys, values, starts, fill = _static_layer(gen, fills, caps, group, 32, dtype)
    if shared:
        idx = _selected_slots(gen, fills, caps, 3, k)[:, None, :].expand(-1, group, -1)
        assert idx.stride(1) == 0
    else:
        idx = torch.stack([_selected_slots(gen, fills, caps, 3, k) for _ in range(group)], dim=1)
    out = flash_decode_selected(q, keys, values, starts, fill, idx, 0.3)
    _close_to_fp32(out, _selected_oracle(q, keys, values, starts, fills, caps, idx, 0.3))


@pytest.mark.skipif(DEVICE != "cpu", reason="traces the operator on CPU tensors (interpreted launch)")
def test_flash_decode_is_one_operator_in_a_compiled_graph():
    from kvbench.kernels.flash_decode import flash_decode

    gen = torch.Generator().manual_seed(7)
    q, keys, values, starts, fill = _static_layer(gen, [20, 50], [64, 64], 4, 16, torch.float32)
    keys, values = keys.nan_to_num(), values.nan_to_num()  # the traced call runs the fake first: no NaN needed
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    step = torch.compile(lambda *a: flash_decode(*a, 0.3) * 2, backend=backend, fullgraph=True, dynamic=False)
    out = step(q, keys, values, starts, fill)
    fill.add_(1)  # the lengths are data: the next step replays the same graph
    again = step(q, keys, values, starts, fill)
    assert len(graphs) == 1
    ops = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert torch.ops.kvbench.flash_decode in ops or torch.ops.kvbench.flash_decode.default in ops
    torch.testing.assert_close(out, 2 * flash_decode(q, keys, values, starts, fill - 1, 0.3))
    torch.testing.assert_close(again, 2 * _per_head_attention(q, keys, values, starts, [21, 51], 0.3), **FP32_TOL)


@pytest.mark.skipif(DEVICE != "cpu", reason="forces the operator onto CPU tensors (interpreted launch)")
@pytest.mark.parametrize("method, budget", [("full", 10**6), ("adakv", 48), ("streamingllm_rolling", 40),
                                            ("quest", 48), ("exact_topk", 40), ("rocketkv", 64), ("sparq", 48),
                                            ("hsa", 64)])
def test_a_compiled_step_attending_by_flash_decode_keeps_the_eager_tokens(tiny_llama, monkeypatch, method, budget):
    """The static layout's dense attention by the operator (uniform, ragged, and a layer that evicts into its
    slots while decoding) and the selection methods' selected slots by its indexed form (a group's pages,
    Exact-TopK's per-query-head tokens, RocketKV's two stages, SparQ's shared tokens), chosen by the stable top-k
    operator from scores and page bounds by the group-scores operator, as on CUDA, here with the launches
    interpreted: the compiled step (dynamo's eager backend) gives the eager path's tokens and logits."""
    import kvbench.cache.static as static_layout
    import kvbench.engine.compiled as compiled
    import kvbench.kernels.distinct_rows as distinct_rows_module
    import kvbench.kernels.flash_decode as flash_decode_module
    import kvbench.kernels.group_scores as group_scores_module
    import kvbench.kernels.stable_topk as stable_topk_module
    from kvbench.engine.session import Session
    from kvbench.methods import build_method
    from tests.conftest import random_ids

    calls = []
    monkeypatch.setattr(static_layout, "flash_decode_applies", lambda keys: True)
    real_op = torch.ops.kvbench.flash_decode
    monkeypatch.setattr(static_layout, "flash_decode",
                        lambda *a: calls.append(a[-1]) or real_op(*a))
    selected = []
    real_selected = flash_decode_module.flash_decode_selected
    monkeypatch.setattr(static_layout, "flash_decode_selected",
                        lambda *a: selected.append(a[-2].shape) or real_selected(*a))
    tops = []
    monkeypatch.setattr(stable_topk_module, "triton_launchable", lambda *tensors: True)
    real_top = _stable_topk_kernels.launch_stable_topk
    monkeypatch.setattr(_stable_topk_kernels, "launch_stable_topk",
                        lambda *a, **kw: tops.append(a[1]) or real_top(*a, **kw))
    monkeypatch.setattr(stable_topk_module.FALLBACK, "failed", [])  # a launch error would take the reference
    scored = []  # SparQ's reduced scores and Exact-TopK's exact logits by the group-scores operator, as on CUDA
    monkeypatch.setattr(group_scores_module, "triton_launchable", lambda *tensors: True)
    real_scores = _group_scores_kernels.launch_group_scores
    monkeypatch.setattr(_group_scores_kernels, "launch_group_scores",
                        lambda *a, **kw: scored.append(a[2] is None) or real_scores(*a, **kw))
    monkeypatch.setattr(group_scores_module.FALLBACK, "failed", [])
    counted = []  # Exact-TopK's per-query-head traffic by the distinct-rows operator, as on CUDA
    monkeypatch.setattr(distinct_rows_module, "triton_launchable", lambda *tensors: True)
    real_count = _distinct_rows_kernels.launch_distinct_rows
    monkeypatch.setattr(_distinct_rows_kernels, "launch_distinct_rows",
                        lambda *a: counted.append(a[1]) or real_count(*a))
    monkeypatch.setattr(distinct_rows_module.FALLBACK, "failed", [])
    ids = random_ids(150, seed=8)
    settings = {"adakv": {"window": 8}, "streamingllm_rolling": {"decode_every": 1}}.get(method, {})

    def run(decoder, steps=6):
        session = Session(tiny_llama, build_method(method.removesuffix("_rolling"), **settings), budget)
        logits, _ = session.prefill(ids, compress=True)
        session.decoder = decoder
        session.begin_decode(steps)
        tokens, every = [int(logits.argmax())], []
        for _ in range(steps):
            every.append(session.step(tokens[-1]))
            tokens.append(int(every[-1].argmax()))
        session.end_decode()
        return session, tokens, torch.stack(every)

    eager, eager_tokens, eager_logits = run(None)
    assert not calls
    static, static_tokens, static_logits = run(compiled.CompiledDecoder(tiny_llama, "eager"))
    assert static.decode_path == "compiled" and (calls or selected)  # traced through the operator
    assert bool(selected) == static.method.selects  # a selection's slots by the indexed operator
    assert bool(tops) == static.method.selects and not stable_topk_module.FALLBACK.failed  # by the operator
    # every dimension (exact logits, Quest's bounds) / chosen ones (SparQ's, HSA's and RocketKV's estimates)
    assert set(scored) == {"exact_topk": {True}, "quest": {True}, "sparq": {False}, "hsa": {False},
                           "rocketkv": {False}}.get(method, set())
    assert not group_scores_module.FALLBACK.failed
    assert bool(counted) == (method == "exact_topk") and not distinct_rows_module.FALLBACK.failed
    assert static_tokens == eager_tokens
    torch.testing.assert_close(static_logits, eager_logits, atol=1e-4, rtol=1e-4)
    assert [layer.lengths() for layer in static.cache.layers] == [layer.lengths() for layer in eager.cache.layers]


# -- the stable top-k of the selection methods (kvbench::stable_topk) -----------------------------------------

launch_stable_topk = _on_device(_stable_topk_kernels.launch_stable_topk)


def _scores_with_ties(gen, rows, length, dtype):
    """Rows of scores with every hard case of an order: many ties (integer values), -0.0 beside 0.0, +-inf, a
    NaN, runs of -inf (a static layer's unused slots)."""
    scores = torch.randint(-4, 5, (rows, length), generator=gen).float()
    scores[:, ::5] += torch.randn(rows, len(range(0, length, 5)), generator=gen)  # and distinct values
    scores[0, 1::7] = -0.0
    scores[-1, length // 2:] = float("-inf")
    scores[0, 3 % length] = float("inf")
    if rows > 1 and length > 10:
        scores[1, 10] = float("nan")
    return scores.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows, length, k, block", [
    (3, 100, 7, None),       # one program per row, its block the row's power of two
    (2, 50, 50, None),       # every score taken
    (4, 300, 1, None),       # the top one only
    (2, 1000, 129, None),    # k not a power of two
    (1, 9, 4, None),         # a row shorter than the smallest block
    (3, 1000, 10, 128),      # segments of 128: 8, the last one short, then their 80 candidates
    (2, 700, 40, 128),       # 6 segments whose top 40 tie across segments, 240 candidates, then 80: three levels
    (2, 270, 40, 128),       # a last segment of 14 < k: padded, the padding never chosen
    (2, 9000, 3, 1024),      # 9 segments of 1,024
])
def test_stable_topk_triton_is_the_reference(rows, length, k, block, dtype):
    """The kernel returns the reference's indices exactly, in its order: ties to the lower index, -0.0 tied with
    0.0, NaN first, -inf last; a long row by segments, then their candidates, the same. Unordered, the same
    indices in ascending order."""
    from kvbench.kernels.stable_topk import stable_topk_reference

    scores = _scores_with_ties(torch.Generator().manual_seed(length + k), rows, length, dtype)
    reference = stable_topk_reference(scores, k)
    assert torch.equal(launch_stable_topk(scores, k, block), reference)
    assert torch.equal(launch_stable_topk(scores, k, block, ordered=False), reference.sort(dim=-1).values)


@pytest.mark.parametrize("ordered", [True, False])
def test_stable_topk_triton_stops_its_bisection_early_only_where_no_tie_crosses_the_kth(ordered):
    """Distinct scores stop the bisection at a midpoint with exactly k scores at or above it (the usual case:
    about 19 counts of 32 for 8,192 logits); a tie across the k-th score (row 1: the k-th and (k+1)-th equal)
    needs every count. Both keep the reference's indices, through two levels of segments."""
    from kvbench.kernels.stable_topk import stable_topk_reference

    scores = torch.randn(3, 1500, generator=torch.Generator().manual_seed(5))
    order = scores[1].sort(descending=True).indices
    scores[1, order[60]] = scores[1, order[59]]  # the 60th and 61st tie: the lower index is kept
    scores[2] = scores[2].exp() / scores[2].exp().sum()  # probabilities, like SparQ's estimate
    reference = stable_topk_reference(scores, 60)
    got = launch_stable_topk(scores, 60, 256, ordered=ordered)
    assert torch.equal(got, reference if ordered else reference.sort(dim=-1).values)


def test_stable_topk_triton_strided_rows_and_a_row_of_one_value():
    from kvbench.kernels.stable_topk import stable_topk_reference

    scores = torch.randn(40, 6, generator=torch.Generator().manual_seed(3)).t()  # a column stride
    scores[2] = 1.5  # one value: the k lowest indices
    assert torch.equal(launch_stable_topk(scores, 9, 32), stable_topk_reference(scores, 9))  # segments 32 and 8
    assert launch_stable_topk(scores, 9, 32)[2].tolist() == list(range(9))
    with pytest.raises(ValueError, match="at least 2k"):  # a level of 16-score segments would not halve 9 x 3
        launch_stable_topk(scores, 9, 16)
def test_stable_topk_reference_is_a_stable_descending_sort():
    from kvbench.kernels.stable_topk import stable_topk_reference

    scores = _scores_with_ties(torch.Generator().manual_seed(4), 3, 200, torch.float32)
    nan = scores.isnan()
    order = torch.where(nan, float("inf"), scores).sort(dim=-1, descending=True, stable=True).indices
    # a NaN sorts first, above +inf: the row holding one puts it before its +inf
    order[1] = torch.cat([nan[1].nonzero()[:, 0], order[1][~nan[1][order[1]]]])
    assert torch.equal(stable_topk_reference(scores, 37), order[:, :37])


@pytest.mark.skipif(DEVICE != "cpu", reason="traces the operator on CPU tensors (interpreted launch)")
def test_stable_topk_is_one_operator_in_a_compiled_graph_and_the_reference_on_the_cpu(monkeypatch):
    import kvbench.kernels.stable_topk as stable_topk_module

    scores = _scores_with_ties(torch.Generator().manual_seed(5), 4, 120, torch.float32)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def ops_in(fn):
        graphs.clear()
        torch._dynamo.reset()
        out = torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)(scores)
        return out, {n.target for g in graphs for n in g.graph.nodes if n.op in ("call_function", "call_method")}

    fn = lambda s: stable_topk_module.stable_topk(s.view(2, 2, 120), 10)  # noqa: E731 - leading dims kept
    out, ops = ops_in(fn)  # CPU: the reference, traced (inductor writes its code, as before the kernel)
    kernel = {torch.ops.kvbench.stable_topk, torch.ops.kvbench.stable_topk.default}
    assert not ops & kernel and "topk" in ops
    monkeypatch.setattr(stable_topk_module, "triton_launchable", lambda *tensors: True)  # as on CUDA
    monkeypatch.setattr(stable_topk_module.FALLBACK, "failed", [])
    kernel_out, ops = ops_in(fn)
    assert ops & kernel and "topk" not in ops and not stable_topk_module.FALLBACK.failed  # launched, not replaced
    assert torch.equal(kernel_out, out) and kernel_out.shape == (2, 2, 10)
    # a k the kernel's one-block sort does not take, and an empty row, go to the reference
    assert torch.equal(stable_topk_module.stable_topk(scores, stable_topk_module.MAX_K + 1),
                       stable_topk_module.stable_topk_reference(scores, 120))
    with pytest.raises(ValueError, match="stable_topk"):
        torch.ops.kvbench.stable_topk(scores, 121)


def test_a_failing_stable_topk_launch_warns_once_and_the_reference_runs(monkeypatch, caplog):
    import kvbench.kernels.stable_topk as stable_topk_module

    monkeypatch.setattr(stable_topk_module.FALLBACK, "failed", [])
    launches = []

    def refused(scores, k, ordered=True):
        launches.append(k)
        raise RuntimeError("PassManager::run failed\nmore lines")

    monkeypatch.setattr(_stable_topk_kernels, "launch_stable_topk", refused)
    scores = _scores_with_ties(torch.Generator().manual_seed(6), 3, 80, torch.float32)
    with caplog.at_level("WARNING", logger="kvbench"):
        for k in (5, 7):
            assert torch.equal(torch.ops.kvbench.stable_topk(scores, k), stable_topk_module.stable_topk_reference(scores, k))
    assert launches == [5]  # not tried again
    warnings = [r.getMessage() for r in caplog.records if "stable_topk" in r.getMessage()]
    assert warnings == ["stable_topk: the Triton kernel failed (RuntimeError: PassManager::run failed); "
                        "PyTorch's int64 topk runs instead"]
