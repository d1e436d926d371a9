"""The Triton kernel behind `kvbench.kernels.distinct_rows`: each row's slots marked in a bitmap by atomic ORs.

Imported only on the first launch (see `kvbench.kernels._dispatch`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # indices one program marks


def launch_distinct_rows(idx: torch.Tensor, length: int) -> torch.Tensor:
    """The number of distinct values of each row of `idx` `[R, m]` (int64 slots in `[0, length)`), summed over
    the rows: a 0-d int64 tensor.

    One zeroed int64 buffer holds a bitmap of each row's `length` slots (64 to a word) and, last, the count.
    Each program ORs the bits of up to `BLOCK` of one row's indices into that row's bitmap. An atomic OR
    returns the word as it was, so of the indices that share a slot (in one program or in several) exactly one
    finds its bit clear: it alone is counted, and the programs add their counts atomically. Two launches (the
    zeroing and this), where the reference's zeroed `[R, length]` mask, scatter and int64 sum were three, the
    scatter and the sum 6 us each per layer of Exact-TopK's compiled step on an H200 (docs/journal/gpu.md section 7)."""
    rows, m = idx.shape
    words = triton.cdiv(length, 64)
    scratch = torch.zeros(rows * words + 1, dtype=torch.int64, device=idx.device)
    if idx.numel():
        _distinct_rows_kernel[(rows, triton.cdiv(m, BLOCK))](
            idx, scratch, m, words, *idx.stride(), BLOCK=min(BLOCK, triton.next_power_of_2(m)), num_warps=4)
    return scratch[-1]


@triton.jit
def _distinct_rows_kernel(idx_ptr, scratch_ptr, m, words, i_row, i_col, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    at = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = at < m
    slot = tl.load(idx_ptr + row * i_row + at * i_col, mask=ok, other=0)
    bit = tl.full([BLOCK], 1, tl.int64) << (slot & 63)
    before = tl.atomic_or(scratch_ptr + row * words + (slot >> 6), bit, mask=ok)
    first = ok & ((before & bit) == 0)
    tl.atomic_add(scratch_ptr + tl.num_programs(0).to(tl.int64) * words, tl.sum(first.to(tl.int64), axis=0))
