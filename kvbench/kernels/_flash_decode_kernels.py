"""The Triton kernels behind `kvbench.kernels.flash_decode`: split-K decode attention over the static layout.

Imported only on the first launch (see `kvbench.kernels._dispatch`). Unlike the GEMV kernels of
`_triton_kernels`, a program here attends every query head of a KV group at once, so its products are tiles
(`tl.dot`, the group padded to 16 rows) and each K/V row is read once per group.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kvbench.kernels._triton_kernels import LOG2E


def launch_flash_decode(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    starts: torch.Tensor,
    fill: torch.Tensor,
    scaling: float,
    rows_per_head: int,
    splits: int,
    block_n: int,
    idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run the split-K flash-decoding kernels on shape-checked inputs; see `kvbench.kernels.flash_decode`.

    Pass 1 (`_flash_decode_split_kernel`), one program per (KV head, split): runs of `rows_per_split` of the
    head's first `fill[h]` rows (runs split, split + splits, ...), every query head of the group at once (each
    K/V row read once per KV group, as two tensor-core products per block), an online softmax in fp32, base 2.
    Pass 2 (`_flash_decode_merge_kernel`), one program per query head: the splits' partial results merged by
    log-sum-exp. The split count and the run length depend only on `rows_per_head` (a static shape: the
    buffer's rows per head), never on the device lengths, so the launch is the same at every step of a compiled
    decode loop; a head longer than `splits` runs (a ragged layer's long head) is read by the same programs.

    With `idx` ([H, k] int64 slots), program h reads head h's slots `idx[h, :]` instead of its first `fill[h]`
    rows (a selection method's rows), a slot at or past `fill[h]` counting as no row; the runs are then sized
    by k (pass `rows_per_head=k`).
    """
    n_kv, group, dim = q.shape
    rows_per_split = triton.cdiv(triton.cdiv(rows_per_head, splits), block_n) * block_n
    acc = torch.empty((n_kv, splits, group, dim), dtype=torch.float32, device=q.device)
    running_max = torch.empty((n_kv, splits, group), dtype=torch.float32, device=q.device)
    normaliser = torch.empty_like(running_max)
    block_d = max(16, triton.next_power_of_2(dim))
    indexed = idx is not None
    _flash_decode_split_kernel[(n_kv, splits)](
        q, keys, values, starts, fill, idx if indexed else fill, acc, running_max, normaliser,
        scaling * LOG2E, group, dim, rows_per_split, idx.shape[1] if indexed else 0,
        *q.stride(), *keys.stride(), *values.stride(), *(idx.stride() if indexed else (0, 0)),
        BLOCK_G=max(16, triton.next_power_of_2(group)),  # tl.dot's smallest tile: padded query rows are zeros
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        # fp32 inputs: full-precision products, not TF32. Triton's interpreter multiplies bf16 tiles wrongly
        # (triton 3.9: it reads their bits as another type), so there every dtype is widened first, exactly
        IEEE=q.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
        INDEXED=indexed,
        num_warps=4,
    )
    out = torch.empty_like(q)
    _flash_decode_merge_kernel[(n_kv * group,)](
        acc, running_max, normaliser, out,
        group, dim, splits, *out.stride(),
        BLOCK_S=triton.next_power_of_2(splits),
        BLOCK_D=block_d,
    )
    return out


@triton.jit
def _flash_decode_split_kernel(
    q_ptr, k_ptr, v_ptr, start_ptr, fill_ptr, idx_ptr, acc_ptr, m_ptr, l_ptr,
    qk_scale, group, dim, rows_per_split, selected,
    s_qh, s_qg, s_qd, s_kn, s_kd, s_vn, s_vd, s_ih, s_ik,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
    INDEXED: tl.constexpr,
):
    h = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    splits = tl.num_programs(1)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_ok = g < group
    d_ok = d < dim
    q = tl.load(q_ptr + h * s_qh + g[:, None] * s_qg + d[None, :] * s_qd, mask=g_ok[:, None] & d_ok[None, :],
                other=0.0)
    first = tl.load(start_ptr + h)
    held = tl.load(fill_ptr + h)
    n = selected if INDEXED else held  # entries this head's programs walk: its selected slots, or its held rows
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    # unindexed, every block holds at least one live row, so m_new is finite and exp2 never sees -inf - -inf;
    # the rows at or past the head's fill are never loaded (that is the point: the capacity's slack costs no bytes)
    for run in range(split, tl.cdiv(n, rows_per_split), splits):
        begin = run * rows_per_split
        end = tl.minimum(begin + rows_per_split, n)
        for block in range(begin, end, BLOCK_N):
            r = block + tl.arange(0, BLOCK_N)
            live = r < end
            if INDEXED:  # a selected slot past the head's fill (a selection over padding) is no row
                slot = tl.load(idx_ptr + h * s_ih + r * s_ik, mask=live, other=0)
                live = live & (slot < held)
                rows = first + slot
            else:
                rows = first + r
            tile = live[:, None] & d_ok[None, :]
            kt = tl.load(k_ptr + rows[:, None] * s_kn + d[None, :] * s_kd, mask=tile, other=0.0)
            if IEEE:
                s = tl.dot(q.to(tl.float32), tl.trans(kt.to(tl.float32)), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(kt))
            s = tl.where(live[None, :], s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_ref = m_new
            if INDEXED:  # selected slots may hold no row up to here (m_new -inf): keep exp2 off -inf - -inf
                m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_ref)
            p = tl.exp2(s - m_ref[:, None])
            vt = tl.load(v_ptr + rows[:, None] * s_vn + d[None, :] * s_vd, mask=tile, other=0.0)
            # the probabilities stay fp32: a bf16 cast (flash attention's) costs a whole bf16 ulp of the output,
            # and one TF32 product (10 bits of p) was 1e-4 off on an H100 (docs/journal/gpu.md); three TF32 products
            # (tf32x3) are fp32's rounding on tensor cores. Decoding is bound by the reads, not these products
            if IEEE:
                pv = tl.dot(p, vt.to(tl.float32), input_precision="ieee")
            else:  # p as the sum of two values of V's dtype, each product exact: p to ~16 bits, at tensor-core rate
                p_hi = p.to(vt.dtype)
                pv = tl.dot(p_hi, vt) + tl.dot((p - p_hi.to(tl.float32)).to(vt.dtype), vt)
            acc = acc * alpha[:, None] + pv
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new
    # a split past its head's rows never enters the loops: m = -inf, l = 0, acc = 0, no weight in the merge
    slot = (h * splits + split) * group + g
    tl.store(acc_ptr + slot[:, None] * dim + d[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])
    tl.store(m_ptr + slot, m_i, mask=g_ok)
    tl.store(l_ptr + slot, l_i, mask=g_ok)


@triton.jit
def _flash_decode_merge_kernel(
    acc_ptr, m_ptr, l_ptr, out_ptr,
    group, dim, splits, s_oh, s_og, s_od,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    h = (pid // group).to(tl.int64)
    g = pid % group
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_ok = s < splits
    d_ok = d < dim
    slot = (h * splits + s) * group + g
    m = tl.load(m_ptr + slot, mask=s_ok, other=float("-inf"))
    norm = tl.load(l_ptr + slot, mask=s_ok, other=0.0)
    top = tl.max(m, axis=0)
    # an empty head (no split saw a row) keeps every weight at 0: 0 / 0 = NaN, as the reference's softmax over
    # nothing; subtracting 0 instead of -inf keeps exp2 from -inf - -inf = NaN for the other heads' empty splits
    w = tl.exp2(m - tl.where(top == float("-inf"), 0.0, top))
    acc = tl.load(acc_ptr + slot[:, None] * dim + d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    out = tl.sum(w[:, None] * acc, axis=0) / tl.sum(w * norm, axis=0)
    tl.store(out_ptr + h * s_oh + g * s_og + d * s_od, out.to(out_ptr.dtype.element_ty), mask=d_ok)
