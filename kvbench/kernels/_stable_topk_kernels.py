"""The Triton kernel behind `kvbench.kernels.stable_topk`: the stable top-k of each row (or segment of a long row).

Imported only on the first launch (see `kvbench.kernels._dispatch`).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

BLOCK = 2048  # scores read per iteration of a pass
MIN_SEGMENT = 2048  # a row up to twice this is one program's (a page row: a second launch would cost more)
NUM_WARPS = 8


def launch_stable_topk(scores: torch.Tensor, k: int, block: int = BLOCK, segment: int | None = None) -> torch.Tensor:
    """Indices [R, k] (int64) of each row's k highest scores of `scores` [R, L], in the order of a stable
    descending sort (`stable_topk.stable_topk_reference`), for 0 < k <= L.

    A program finds the top k of one row, or of one segment of a long row (`_stable_topk_kernel`). Each score is
    mapped to its 32 order-preserving bits (`descending_keys`' high half, with the sign bit flipped so that the
    unsigned order of the bits is the order of the scores). Passes 1-4 are a radix select from the top byte
    down: each counts, in a 256-bin histogram, the next byte of the scores whose higher bytes equal the prefix
    found so far, and takes the byte whose bin holds the k-th highest. They end with T, the k-th highest score's
    bits, and `need`, how many of the scores equal to T are among the k (the others are above T). Pass 5 walks
    the row in index order and writes the rows above T and the first `need` rows equal to T: which tied rows a
    stable sort keeps is the lowest indices. Then the k written indices are read back, keyed as
    `descending_keys` keys them, and sorted in one block: the reference's order.

    A program's passes are work for one SM, so a row much longer than k is cut into segments of `segment` scores
    (the last one longer), one program each, and the segments' top k (k x segments candidates, in segment order)
    go through the kernel again: every score of the row's top k is in its segment's top k, and among equal
    scores a candidate's position orders them as its index does, so the second pass returns the same k in the
    same order. `segment` defaults to about sqrt(L k) (the two passes' rows balanced), at least 4 k and
    `MIN_SEGMENT`."""
    rows, length = scores.shape
    segment = segment or max(4 * k, MIN_SEGMENT, triton.next_power_of_2(int(math.sqrt(length * k))))
    segments = length // segment if length >= 2 * segment else 1
    out = torch.empty((rows, segments, k), dtype=torch.int64, device=scores.device)
    _stable_topk_kernel[(rows, segments)](
        scores, out, length, k, length if segments == 1 else segment, *scores.stride(), *out.stride(),
        BLOCK=min(block, triton.next_power_of_2(length if segments == 1 else 2 * segment)),
        BLOCK_K=triton.next_power_of_2(k),
        num_warps=NUM_WARPS,
    )
    if segments == 1:
        return out.view(rows, k)
    candidates = out.view(rows, segments * k)
    chosen = launch_stable_topk(scores.gather(1, candidates), k, block, segment=segments * k)  # one segment
    return candidates.gather(1, chosen)


@triton.jit
def _ordered_bits(ptr, i, ok):
    """`descending_keys`' high half of the scores at `ptr + i` (int32, signed order = the scores' order)."""
    x = tl.load(ptr + i, mask=ok, other=0.0).to(tl.float32)
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 ties with 0.0
    bits = x.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _radix_pass(row_ptr, stride, length, prefix, need, SHIFT: tl.constexpr, BLOCK: tl.constexpr):
    """One pass of the radix select: the byte at SHIFT of the k-th highest (the `need`-th highest of the scores
    whose bytes above SHIFT equal `prefix`'s). Bits are compared with the sign bit flipped (unsigned order)."""
    offsets = tl.arange(0, BLOCK)
    bins = tl.arange(0, 256)
    counts = tl.zeros([256], dtype=tl.int32)
    for start in range(0, length, BLOCK):
        i = start + offsets
        ok = i < length
        u = _ordered_bits(row_ptr, i * stride, ok) ^ -2147483648  # sign flipped: unsigned order
        if SHIFT < 24:
            ok = ok & ((u >> (SHIFT + 8)) == (prefix >> (SHIFT + 8)))  # arithmetic shifts on both: same bits
        counts += tl.histogram((u >> SHIFT) & 255, 256, mask=ok)
    at_or_above = tl.sum(counts, axis=0) - tl.cumsum(counts, 0) + counts  # scores whose byte is >= each bin's
    byte = tl.sum((at_or_above >= need).to(tl.int32), axis=0) - 1  # the highest bin still holding the need-th
    above = tl.sum(tl.where(bins > byte, counts, 0), axis=0)
    return prefix | (byte << SHIFT), need - above


@triton.jit
def _stable_topk_kernel(
    s_ptr, out_ptr, length, k, segment,
    s_row, s_col, o_row, o_seg, o_col,
    BLOCK: tl.constexpr, BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    seg = tl.program_id(1)
    first = seg * segment  # this program's scores: [first, first + segment), the last segment to the row's end
    count = tl.where(seg == tl.num_programs(1) - 1, length - first, segment)
    row_ptr = s_ptr + row * s_row + first.to(tl.int64) * s_col
    out_row = out_ptr + row * o_row + seg.to(tl.int64) * o_seg
    prefix = tl.zeros([], dtype=tl.int32)
    need = k + tl.zeros([], dtype=tl.int32)
    prefix, need = _radix_pass(row_ptr, s_col, count, prefix, need, 24, BLOCK)
    prefix, need = _radix_pass(row_ptr, s_col, count, prefix, need, 16, BLOCK)
    prefix, need = _radix_pass(row_ptr, s_col, count, prefix, need, 8, BLOCK)
    prefix, need = _radix_pass(row_ptr, s_col, count, prefix, need, 0, BLOCK)
    threshold = prefix ^ -2147483648  # the k-th highest score's bits, back in signed order
    offsets = tl.arange(0, BLOCK)
    taken = tl.zeros([], dtype=tl.int32)
    ties = tl.zeros([], dtype=tl.int32)
    for start in range(0, count, BLOCK):
        i = start + offsets
        ok = i < count
        bits = _ordered_bits(row_ptr, i * s_col, ok)
        tied = (ok & (bits == threshold)).to(tl.int32)
        tie_rank = ties + tl.cumsum(tied, 0) - tied  # tied rows before this one
        chosen = ok & ((bits > threshold) | ((tied == 1) & (tie_rank < need)))
        c = chosen.to(tl.int32)
        tl.store(out_row + (taken + tl.cumsum(c, 0) - c) * o_col, i.to(tl.int64), mask=chosen)
        taken += tl.sum(c, axis=0)
        ties += tl.sum(tied, axis=0)
    tl.debug_barrier()  # this program's writes above are read back by its other threads below
    j = tl.arange(0, BLOCK_K)
    live = j < k
    idx = tl.load(out_row + j * o_col, mask=live, other=0)
    keys = (_ordered_bits(row_ptr, idx * s_col, live).to(tl.int64) << 32) | (2147483647 - idx)
    keys = tl.sort(tl.where(live, keys, -9223372036854775807 - 1), descending=True)  # padding sorts last
    tl.store(out_row + j * o_col, first.to(tl.int64) + (2147483647 - (keys - ((keys >> 32) << 32))), mask=live)
