"""The Triton kernel behind `kvbench.kernels.group_scores`.

Imported only on the first launch (see `kvbench.kernels._dispatch`).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

BLOCK_N = 128  # keys per program
MAX_BLOCK_R = 64  # head dimensions per product


def launch_group_scores(q: torch.Tensor, keys_t: torch.Tensor, dims: torch.Tensor | None,
                        block_n: int = BLOCK_N) -> torch.Tensor:
    """`group_scores.group_scores` on shape-checked inputs: [H, G, N] float32.

    One program per (KV head, block of `block_n` keys): the group's query heads (padded to 16 rows, tl.dot's
    smallest tile) times the keys' chosen dimensions, `BLOCK_R` dimensions at a time, accumulated in float32.
    bf16 and fp16 products are exact in float32; float32 inputs (or mixed dtypes) take full-precision products,
    not TF32. Only the order of the sums differs from the references."""
    heads, group, dim = q.shape
    n = keys_t.shape[2]
    r = dim if dims is None else dims.shape[1]
    out = torch.empty((heads, group, n), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out
    block_n = min(block_n, max(16, triton.next_power_of_2(n)))
    interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    _group_scores_kernel[(heads, triton.cdiv(n, block_n))](
        q, keys_t, q if dims is None else dims, out,
        group, n, r,
        *q.stride(), *keys_t.stride(), *((0, 0) if dims is None else dims.stride()), *out.stride(),
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_N=block_n,
        BLOCK_R=min(MAX_BLOCK_R, max(16, triton.next_power_of_2(r))),
        GATHER=dims is not None,
        # Triton's interpreter multiplies bf16 tiles wrongly (as in `_flash_decode_kernels`): widened there, exactly
        IEEE=q.dtype == torch.float32 or q.dtype != keys_t.dtype or interpreted,
        num_warps=4,
    )
    return out


@triton.jit
def _group_scores_kernel(
    q_ptr, k_ptr, dims_ptr, out_ptr,
    group, n, r,
    s_qh, s_qg, s_qd, s_kh, s_kd, s_kn, s_dh, s_dr, s_oh, s_og, s_on,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, GATHER: tl.constexpr,
    IEEE: tl.constexpr,
):
    h = tl.program_id(0).to(tl.int64)  # int64: h * s_kh passes 2^31 once H * D * N does
    t = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    t_ok = t < n
    g = tl.arange(0, BLOCK_G)
    g_ok = g < group
    acc = tl.zeros([BLOCK_G, BLOCK_N], dtype=tl.float32)
    for j0 in range(0, r, BLOCK_R):
        j = j0 + tl.arange(0, BLOCK_R)
        j_ok = j < r
        if GATHER:
            dd = tl.load(dims_ptr + h * s_dh + j * s_dr, mask=j_ok, other=0)
        else:
            dd = j
        qs = tl.load(q_ptr + h * s_qh + g[:, None] * s_qg + dd[None, :] * s_qd, mask=g_ok[:, None] & j_ok[None, :],
                     other=0.0)
        kt = tl.load(k_ptr + h * s_kh + dd[:, None] * s_kd + t[None, :] * s_kn, mask=j_ok[:, None] & t_ok[None, :],
                     other=0.0)
        if IEEE:
            acc += tl.dot(qs.to(tl.float32), kt.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(qs, kt)
    tl.store(out_ptr + h * s_oh + g[:, None] * s_og + t[None, :] * s_on, acc, mask=g_ok[:, None] & t_ok[None, :])
