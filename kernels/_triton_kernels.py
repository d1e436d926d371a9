"""The Triton kernels behind `kvbench.kernels.sparse_attention` and `kvbench.kernels.ragged_attention`.

Imported only on the first Triton launch (see `kvbench.kernels._dispatch`). Both kernels are decode-time
GEMVs, one program per (KV head, group member) with an online softmax in fp32, so they use elementwise
products and reductions rather than tl.dot (a single query row is below tl.dot's minimum tile).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# softmax in base 2 (exp2 is the native instruction): log2(e) is folded into the logit scale
LOG2E = 1.4426950408889634


def launch_topk_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    idx: torch.Tensor,
    scaling: float,
    valid: torch.Tensor | None,
    block_k: int,
) -> torch.Tensor:
    """Run `_topk_attention_kernel` on shape-checked inputs; see `topk_attention_triton`."""
    n_kv, group, k = idx.shape
    dim = q.shape[-1]
    out = torch.empty_like(q)
    if valid is None:
        valid_u8, valid_strides = idx, (0, 0)  # never read: HAS_VALID is False
    else:
        valid_u8 = valid.view(torch.uint8)  # loaded as bytes; a bool tensor is one byte per slot
        valid_strides = valid_u8.stride()
    _topk_attention_kernel[(n_kv * group,)](
        q, keys, values, idx, valid_u8, out,
        scaling * LOG2E, group, k, dim,
        *q.stride(), *keys.stride(), *values.stride(), *idx.stride(), *valid_strides, *out.stride(),
        HAS_VALID=valid is not None,
        BLOCK_K=min(block_k, triton.next_power_of_2(max(k, 1))),
        BLOCK_D=triton.next_power_of_2(dim),
    )
    return out


@triton.jit
def _topk_attention_kernel(
    q_ptr, k_ptr, v_ptr, idx_ptr, valid_ptr, out_ptr,
    qk_scale, group, k, dim,
    s_qh, s_qg, s_qd, s_kh, s_kl, s_kd, s_vh, s_vl, s_vd, s_ih, s_ig, s_ik, s_mh, s_ml, s_oh, s_og, s_od,
    HAS_VALID: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    # int64: h * s_kh passes 2^31 once H_kv * L * D does (32 heads of 1M tokens at D=128)
    h = (pid // group).to(tl.int64)
    g = pid % group
    d = tl.arange(0, BLOCK_D)
    d_ok = d < dim
    q = tl.load(q_ptr + h * s_qh + g * s_qg + d * s_qd, mask=d_ok, other=0.0).to(tl.float32)
    m_i = tl.full([], float("-inf"), tl.float32)
    l_i = tl.full([], 0.0, tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for start in range(0, k, BLOCK_K):
        j = start + tl.arange(0, BLOCK_K)
        live = j < k
        rows = tl.load(idx_ptr + h * s_ih + g * s_ig + j * s_ik, mask=live, other=0)
        if HAS_VALID:
            live = live & (tl.load(valid_ptr + h * s_mh + rows * s_ml, mask=live, other=0) != 0)
        tile = live[:, None] & d_ok[None, :]
        kt = tl.load(k_ptr + h * s_kh + rows[:, None] * s_kl + d[None, :] * s_kd, mask=tile, other=0.0)
        logits = tl.sum(kt.to(tl.float32) * q[None, :], axis=1) * qk_scale
        logits = tl.where(live, logits, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(logits, axis=0))
        # a block of nothing but padding leaves m_new at -inf; subtracting 0 instead keeps exp2 at 0, not NaN
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(logits - m_ref)
        vt = tl.load(v_ptr + h * s_vh + rows[:, None] * s_vl + d[None, :] * s_vd, mask=tile, other=0.0)
        acc = acc * alpha + tl.sum(p[:, None] * vt.to(tl.float32), axis=0)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        m_i = m_new
    # l_i == 0 (all padding) gives 0/0 = NaN, as the reference's softmax over nothing does
    out = acc / l_i
    tl.store(out_ptr + h * s_oh + g * s_og + d * s_od, out.to(out_ptr.dtype.element_ty), mask=d_ok)


def launch_ragged_decode_attention(
    q: torch.Tensor,
    keys_flat: torch.Tensor,
    values_flat: torch.Tensor,
    offsets: torch.Tensor,
    lens: torch.Tensor,
    scaling: float,
    block_n: int,
) -> torch.Tensor:
    """Run `_ragged_decode_kernel` on shape-checked inputs (int64 offsets/lens on q's device)."""
    n_kv, group, dim = q.shape
    out = torch.empty_like(q)
    _ragged_decode_kernel[(n_kv * group,)](
        q, keys_flat, values_flat, offsets, lens, out,
        scaling * LOG2E, group, dim,
        *q.stride(), *keys_flat.stride(), *values_flat.stride(), *out.stride(),
        BLOCK_N=block_n,
        BLOCK_D=triton.next_power_of_2(dim),
    )
    return out


@triton.jit
def _ragged_decode_kernel(
    q_ptr, k_ptr, v_ptr, off_ptr, len_ptr, out_ptr,
    qk_scale, group, dim,
    s_qh, s_qg, s_qd, s_kn, s_kd, s_vn, s_vd, s_oh, s_og, s_od,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    h = pid // group
    g = pid % group
    d = tl.arange(0, BLOCK_D)
    d_ok = d < dim
    q = tl.load(q_ptr + h * s_qh + g * s_qg + d * s_qd, mask=d_ok, other=0.0).to(tl.float32)
    first = tl.load(off_ptr + h)
    n = tl.load(len_ptr + h)
    m_i = tl.full([], float("-inf"), tl.float32)
    l_i = tl.full([], 0.0, tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    # every block holds at least one live row, so m_new is finite and exp2 never sees -inf - -inf
    for start in range(0, n, BLOCK_N):
        r = start + tl.arange(0, BLOCK_N)
        live = r < n
        rows = first + r
        tile = live[:, None] & d_ok[None, :]
        kt = tl.load(k_ptr + rows[:, None] * s_kn + d[None, :] * s_kd, mask=tile, other=0.0)
        logits = tl.sum(kt.to(tl.float32) * q[None, :], axis=1) * qk_scale
        logits = tl.where(live, logits, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(logits, axis=0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(logits - m_new)
        vt = tl.load(v_ptr + rows[:, None] * s_vn + d[None, :] * s_vd, mask=tile, other=0.0)
        acc = acc * alpha + tl.sum(p[:, None] * vt.to(tl.float32), axis=0)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        m_i = m_new
    # an empty head never enters the loop: 0/0 = NaN, as the reference's softmax over nothing
    out = acc / l_i
    tl.store(out_ptr + h * s_oh + g * s_og + d * s_od, out.to(out_ptr.dtype.element_ty), mask=d_ok)
