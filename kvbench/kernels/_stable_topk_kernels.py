"""The Triton kernel behind `kvbench.kernels.stable_topk`: the stable top-k of each row, by segments held in registers.

Imported only on the first launch (see `kvbench.kernels._dispatch`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 8192  # scores one program holds, 32 a thread at 8 warps: a long row's segment
NUM_WARPS = 8


def launch_stable_topk(scores: torch.Tensor, k: int, block: int | None = None, ordered: bool = True) -> torch.Tensor:
    """Indices [R, k] (int64) of each row's k highest scores of `scores` [R, L], for 0 < k <= L: with `ordered`,
    in the order of a stable descending sort (`stable_topk.stable_topk_reference`); without, the same indices
    in ascending order (no sort at all).

    One program takes a segment of at most `block` scores, loaded once into registers (`_stable_topk_kernel`).
    Each score is mapped to its 32 order-preserving bits (`descending_keys`' high half). The k-th highest's bits
    T are found by bisection over the 2^32 bit patterns, at most 32 counts of the scores at or above a midpoint,
    each a reduction over the registers (the previous kernel's radix select counted 256-bin histograms in 4
    passes over global memory, and histograms cost a Triton program far more than sums: docs/journal/gpu.md section 7); it
    stops early at a midpoint with exactly k scores at or above it. Then the
    scores above T and the first `need` equal to T in index order (which tied rows a stable sort keeps: the
    lowest indices) are written in index order, by a cumulative sum.

    A row longer than `block` is cut into segments of `block` (the last one shorter), one program each, and the
    segments' top k (fewer where a segment holds fewer: padded with -1) become the next level's candidates, in
    segment order, read through their indices, until one segment is left. Every score of the row's top k is in
    its segment's top k, and equal scores keep their index order through every level (a segment writes in
    index order; segments follow each other), so the last level returns the same k. Only there, with
    `ordered`, are the k keyed as `descending_keys` keys them and sorted in one block (the reference's order).
    `block` (a power of two) must be at least 2k so that each level at least halves the candidates."""
    rows, length = scores.shape
    block = block or (max(16, triton.next_power_of_2(length)) if length <= BLOCK else BLOCK)
    if block < 2 * k and length > block:
        raise ValueError(f"stable_topk: a segment of {block} scores cannot take k = {k} (at least 2k)")
    candidates, width = None, length
    while True:
        segments = triton.cdiv(width, block)
        out = torch.empty((rows, segments, k), dtype=torch.int64, device=scores.device)
        last = segments == 1
        _stable_topk_kernel[(rows, segments)](
            scores, out if candidates is None else candidates, out, width, k,
            *scores.stride(), width if candidates is None else candidates.stride(0), segments * k,
            BLOCK=min(block, max(16, triton.next_power_of_2(width))), BLOCK_K=triton.next_power_of_2(k),
            GATHER=candidates is not None, ORDERED=ordered and last,
            num_warps=NUM_WARPS if block >= 4096 else 4,
        )
        if last:
            return out.view(rows, k)
        candidates, width = out.view(rows, segments * k), segments * k


@triton.jit
def _ordered_bits(ptr, i, ok):
    """`descending_keys`' high half of the scores at `ptr + i` (int32, signed order = the scores' order)."""
    x = tl.load(ptr + i, mask=ok, other=0.0).to(tl.float32)
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 ties with 0.0
    bits = x.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _stable_topk_kernel(
    s_ptr, c_ptr, out_ptr, width, k,
    s_row, s_col, c_row, o_row,
    BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, GATHER: tl.constexpr, ORDERED: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    seg = tl.program_id(1)
    position = seg * BLOCK + tl.arange(0, BLOCK)  # in this level's row of `width` scores or candidates
    ok = position < width
    if GATHER:  # the candidates' indices into the row; -1 pads a segment that held fewer than k
        index = tl.load(c_ptr + row * c_row + position, mask=ok, other=-1).to(tl.int32)  # rows < 2^31: registers
        ok = index >= 0
    else:
        index = position
    row_ptr = s_ptr + row * s_row
    bits = _ordered_bits(row_ptr, index * s_col, ok)
    take = tl.minimum(k, tl.sum(ok.to(tl.int32), axis=0))  # k, or all of a short segment
    # bisection: count(bits >= lo) >= take > count(bits >= hi), until hi = lo + 1 (then lo is the take-th's bits)
    # or until exactly `take` scores are at or above lo (then lo is a threshold that keeps them all, ties
    # included: the scores' top `take` have no tie across it). Distinct scores usually stop it well before 32.
    lo = tl.full([], -2147483648, tl.int64)
    hi = tl.full([], 2147483648, tl.int64)
    count = take - take - 1  # not counted yet
    while (hi - lo > 1) & (count != take):
        mid = lo + ((hi - lo) >> 1)
        count = tl.sum((ok & (bits >= mid.to(tl.int32))).to(tl.int32), axis=0)
        enough = count >= take
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough, hi, mid)
    threshold = lo.to(tl.int32)
    above = ok & (bits > threshold)
    tied = (ok & (bits == threshold)).to(tl.int32)
    need = take - tl.sum(above.to(tl.int32), axis=0)
    chosen = above | ((tied == 1) & (tl.cumsum(tied, 0) - tied < need))  # the first `need` ties by index
    c = chosen.to(tl.int32)
    out_row = out_ptr + row * o_row + seg * k
    tl.store(out_row + tl.cumsum(c, 0) - c, index.to(tl.int64), mask=chosen)
    j = tl.arange(0, BLOCK_K)
    tl.store(out_row + j, tl.full([BLOCK_K], -1, tl.int64), mask=(j >= take) & (j < k))
    if ORDERED:  # the last level: the k in the reference's order, keyed as `descending_keys` keys them
        tl.debug_barrier()  # this program's writes above are read back by its other threads below
        live = j < k
        idx = tl.load(out_row + j, mask=live, other=0)
        keys = (_ordered_bits(row_ptr, idx * s_col, live).to(tl.int64) << 32) | (2147483647 - idx)
        keys = tl.sort(tl.where(live, keys, -9223372036854775807 - 1), descending=True)  # padding sorts last
        tl.store(out_row + j, 2147483647 - (keys - ((keys >> 32) << 32)), mask=live)
