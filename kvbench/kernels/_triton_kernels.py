"""The Triton kernels behind `kvbench.kernels.sparse_attention`, `.ragged_attention` and `.page_summary`'s minmax.

Imported only on the first Triton launch (see `kvbench.kernels._dispatch`). The attention kernels are
decode-time GEMVs, one program per (KV head, group member) with an online softmax in fp32, so they use
elementwise products and reductions rather than tl.dot (a single query row is below tl.dot's minimum tile).
(The page scores are `kvbench::group_scores` products: `page_summary.page_scores_by_group_scores`.) Every
launcher takes shape-checked inputs of any strides and returns fresh outputs.
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run `_topk_attention_kernel` on shape-checked inputs; see `topk_attention_triton`.

    Returns (out [H_kv, G, D] in q's dtype, lse [H_kv, G] fp32 natural-log log-sum-exp of the logits).
    """
    n_kv, group, k = idx.shape
    dim = q.shape[-1]
    out = torch.empty_like(q)
    lse = torch.empty((n_kv, group), dtype=torch.float32, device=q.device)
    if valid is None:
        valid_u8, valid_strides = idx, (0, 0)  # never read: HAS_VALID is False
    else:
        valid_u8 = valid.view(torch.uint8)  # loaded as bytes; a bool tensor is one byte per slot
        valid_strides = valid_u8.stride()
    _topk_attention_kernel[(n_kv * group,)](
        q, keys, values, idx, valid_u8, out, lse,
        scaling * LOG2E, group, k, dim,
        *q.stride(), *keys.stride(), *values.stride(), *idx.stride(), *valid_strides, *out.stride(),
        *lse.stride(),
        HAS_VALID=valid is not None,
        BLOCK_K=min(block_k, triton.next_power_of_2(max(k, 1))),
        BLOCK_D=triton.next_power_of_2(dim),
    )
    return out, lse


@triton.jit
def _topk_attention_kernel(
    q_ptr, k_ptr, v_ptr, idx_ptr, valid_ptr, out_ptr, lse_ptr,
    qk_scale, group, k, dim,
    s_qh, s_qg, s_qd, s_kh, s_kl, s_kd, s_vh, s_vl, s_vd, s_ih, s_ig, s_ik, s_mh, s_ml, s_oh, s_og, s_od,
    s_lh, s_lg,
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
    # m_i and l_i are in base 2 (the logits carry LOG2E; a jitted function cannot read that global, hence the
    # literal ln 2); all padding leaves m_i = -inf and l_i = 0, and -inf + log2(0) is the reference's -inf
    tl.store(lse_ptr + h * s_lh + g * s_lg, (m_i + tl.log2(l_i)) * 0.6931471805599453)


def launch_ragged_decode_attention(
    q: torch.Tensor,
    keys_flat: torch.Tensor,
    values_flat: torch.Tensor,
    offsets: torch.Tensor,
    lens: torch.Tensor,
    scaling: float,
    block_n: int,
    max_len: int,
    rows_per_split: int,
) -> torch.Tensor:
    """Run `_ragged_decode_kernel` on shape-checked inputs (int64 offsets/lens on q's device), split-K.

    Each (KV head, group member) gets ceil(max_len / rows_per_split) programs, each over its own run of rows
    with an online softmax; their partial results (unnormalised sum, running max, normaliser; base 2) are
    merged here by log-sum-exp, so a long head is read by many programs at once instead of one.
    """
    n_kv, group, dim = q.shape
    rows_per_split = max(block_n, -(-rows_per_split // block_n) * block_n)
    splits = max(1, -(-max_len // rows_per_split))
    acc = torch.empty(n_kv, group, splits, dim, dtype=torch.float32, device=q.device)
    running_max = torch.empty(n_kv, group, splits, dtype=torch.float32, device=q.device)
    normaliser = torch.empty_like(running_max)
    _ragged_decode_kernel[(n_kv * group, splits)](
        q, keys_flat, values_flat, offsets, lens, acc, running_max, normaliser,
        scaling * LOG2E, group, dim, rows_per_split,
        *q.stride(), *keys_flat.stride(), *values_flat.stride(),
        BLOCK_N=block_n,
        BLOCK_D=triton.next_power_of_2(dim),
    )
    top = running_max.amax(dim=-1, keepdim=True)  # -inf only for an empty head: NaN below, as the reference
    weight = torch.exp2(running_max - top)
    out = (weight[..., None] * acc).sum(dim=2) / (weight * normaliser).sum(dim=-1)[..., None]
    return out.to(q.dtype)


@triton.jit
def _ragged_decode_kernel(
    q_ptr, k_ptr, v_ptr, off_ptr, len_ptr, acc_ptr, m_ptr, l_ptr,
    qk_scale, group, dim, rows_per_split,
    s_qh, s_qg, s_qd, s_kn, s_kd, s_vn, s_vd,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    splits = tl.num_programs(1)
    h = pid // group
    g = pid % group
    d = tl.arange(0, BLOCK_D)
    d_ok = d < dim
    q = tl.load(q_ptr + h * s_qh + g * s_qg + d * s_qd, mask=d_ok, other=0.0).to(tl.float32)
    first = tl.load(off_ptr + h)
    n = tl.load(len_ptr + h)
    begin = split * rows_per_split
    end = tl.minimum(begin + rows_per_split, n)
    m_i = tl.full([], float("-inf"), tl.float32)
    l_i = tl.full([], 0.0, tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    # every block holds at least one live row, so m_new is finite and exp2 never sees -inf - -inf
    for start in range(begin, end, BLOCK_N):
        r = start + tl.arange(0, BLOCK_N)
        live = r < end
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
    # a split past its head's rows never enters the loop: m = -inf, l = 0, no weight in the merge
    slot = pid * splits + split
    tl.store(acc_ptr + slot * dim + d, acc, mask=d_ok)
    tl.store(m_ptr + slot, m_i)
    tl.store(l_ptr + slot, l_i)


def launch_page_minmax(
    keys: torch.Tensor, page_size: int, block_rows: int = 16, tile: int = 4096
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run `_page_minmax_kernel`: see `page_minmax_reference`. Returns (kmin, kmax), [H, P, D] in keys' dtype.

    One program per (head, block of pages); it walks its pages `block_rows` rows at a time, so a large page
    does not need a [page_size, D] tile in registers and a small one shares a program with its neighbours.
    """
    if keys.dim() != 3 or page_size < 1:
        raise ValueError(f"keys {tuple(keys.shape)} must be [H, N, D] and page_size {page_size} >= 1")
    heads, n, dim = keys.shape
    pages = triton.cdiv(n, page_size)
    kmin = keys.new_empty((heads, pages, dim))
    kmax = keys.new_empty((heads, pages, dim))
    if kmin.numel() == 0:
        return kmin, kmax
    block_d = triton.next_power_of_2(dim)
    block_r = min(triton.next_power_of_2(page_size), block_rows)
    # all three factors are powers of two, so the quotient is one too (as tl.arange requires)
    block_p = max(1, min(triton.next_power_of_2(pages), tile // (block_r * block_d)))
    # pages on grid axis 0: axis 1 is capped at 65535 programs on CUDA
    _page_minmax_kernel[(triton.cdiv(pages, block_p), heads)](
        keys, kmin, kmax,
        n, pages, page_size, dim,
        *keys.stride(), *kmin.stride(), *kmax.stride(),
        BLOCK_P=block_p, BLOCK_R=block_r, BLOCK_D=block_d,
    )
    return kmin, kmax


@triton.jit
def _page_minmax_kernel(
    k_ptr, min_ptr, max_ptr,
    n, pages, page_size, dim,
    s_kh, s_kn, s_kd, s_ih, s_ip, s_id, s_ah, s_ap, s_ad,
    BLOCK_P: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    h = tl.program_id(1).to(tl.int64)
    p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    d = tl.arange(0, BLOCK_D)
    p_ok = p < pages
    d_ok = d < dim
    first = p.to(tl.int64) * page_size
    # the partial last page stops at row n: rows past it are never read, so they cannot widen its bounds
    end = tl.minimum(first + page_size, n)
    lo = tl.full([BLOCK_P, BLOCK_D], float("inf"), tl.float32)
    hi = tl.full([BLOCK_P, BLOCK_D], float("-inf"), tl.float32)
    for r0 in range(0, page_size, BLOCK_R):
        rows = first[:, None] + (r0 + tl.arange(0, BLOCK_R))[None, :]  # [BLOCK_P, BLOCK_R]
        # rows < end also masks a chunk's lanes past page_size (they belong to the next page)
        live = ((rows < end[:, None]) & p_ok[:, None])[:, :, None] & d_ok[None, None, :]
        x = tl.load(k_ptr + h * s_kh + rows[:, :, None] * s_kn + d[None, None, :] * s_kd, mask=live, other=0.0)
        # fp32 holds every fp16/bf16 value exactly: the min/max and the cast back are exact
        x = x.to(tl.float32)
        lo = tl.minimum(lo, tl.min(tl.where(live, x, float("inf")), axis=1))
        hi = tl.maximum(hi, tl.max(tl.where(live, x, float("-inf")), axis=1))
    tile = p_ok[:, None] & d_ok[None, :]
    tl.store(min_ptr + h * s_ih + p[:, None] * s_ip + d[None, :] * s_id, lo.to(min_ptr.dtype.element_ty), mask=tile)
    tl.store(max_ptr + h * s_ah + p[:, None] * s_ap + d[None, :] * s_ad, hi.to(max_ptr.dtype.element_ty), mask=tile)

