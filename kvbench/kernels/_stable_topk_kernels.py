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
# Rows at least this long take the row-parallel path (`launch_stable_topk_by_histogram`): on an H200 the
# per-program path took 97 us for 8 rows of 40,960 scores and k = 1,024 (0.89x inductor's int64 topk), one
# program per segment doing five passes alone (docs/gpu/README.md, section 7)
BY_HISTOGRAM_FROM = 8192
CHUNK = 1024  # scores per program of the row-parallel passes
HIGH_BINS = 1 << 16  # the row-parallel histogram's bins: the top 16 of the scores' 32 order-preserving bits
TIE_KEY_BITS = 47  # a bin's candidates' unique key: the score's low 16 bits, then the reversed index (31 bits)


def launch_stable_topk(scores: torch.Tensor, k: int, block: int = BLOCK, segment: int | None = None,
                       by_histogram: bool | None = None) -> torch.Tensor:
    """Indices [R, k] (int64) of each row's k highest scores of `scores` [R, L], in the order of a stable
    descending sort (`stable_topk.stable_topk_reference`), for 0 < k <= L. A row of at least
    `BY_HISTOGRAM_FROM` scores (unless `segment` is given, or `by_histogram` says otherwise) takes the
    row-parallel path, `launch_stable_topk_by_histogram`; the rest, the per-program path below.

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
    if by_histogram is None:
        by_histogram = segment is None and length >= BY_HISTOGRAM_FROM
    if by_histogram:
        return launch_stable_topk_by_histogram(scores, k)
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


def launch_stable_topk_by_histogram(scores: torch.Tensor, k: int, chunk: int = CHUNK) -> torch.Tensor:
    """`launch_stable_topk`'s indices, with every pass over the row spread over programs of `chunk` scores:

    1. `_high_histogram_kernel` counts each row's scores by their top 16 order-preserving bits (atomic adds into
       a 65,536-bin histogram per row);
    2. `_high_bin_kernel` (a program per row) walks the histogram from the top to the bin B that holds the
       k-th highest score, and counts the scores above it;
    3. `_collect_kernel` writes the indices of the scores above B to the output (they are all taken: fewer
       than k) and those in B to a candidate list, each program's at a place an atomic add reserves;
    4. `_finish_kernel` (a program per row) takes the `need` = k - above best candidates by a radix select
       over a key unique to each candidate (the score's low 16 bits, then the index reversed: ties to the lower
       index), six passes of 8 bits over the candidates alone, usually tens of them; then it sorts the k
       indices by `descending_keys`' key in one block: the reference's order, whatever order the atomic adds
       wrote them in. So the result is exact and deterministic.

    Five launches (with the zeroing of the histogram) and no gathered copies, where the per-program path
    runs two passes of five over the row, one program per segment, and gathers the candidates between them.
    One histogram of 64K int32 per row is the memory it takes (256 KiB), plus an int32 candidate per score."""
    rows, length = scores.shape
    state = torch.zeros((rows, HIGH_BINS + 4), dtype=torch.int32, device=scores.device)  # bins, B, above, counts
    candidates = torch.empty((rows, length), dtype=torch.int32, device=scores.device)
    out = torch.empty((rows, k), dtype=torch.int64, device=scores.device)
    grid = (rows, triton.cdiv(length, chunk))
    _high_histogram_kernel[grid](scores, state, length, *scores.stride(), state.stride(0), CHUNK=chunk, num_warps=4)
    _high_bin_kernel[(rows,)](state, k, state.stride(0), BINS=HIGH_BINS, BLOCK=4096, num_warps=8)
    _collect_kernel[grid](scores, state, candidates, out, length, *scores.stride(), state.stride(0),
                          candidates.stride(0), *out.stride(), BINS=HIGH_BINS, CHUNK=chunk, num_warps=4)
    _finish_kernel[(rows,)](scores, state, candidates, out, k, *scores.stride(), state.stride(0),
                            candidates.stride(0), *out.stride(), BINS=HIGH_BINS, BLOCK=1024,
                            BLOCK_K=triton.next_power_of_2(k), num_warps=NUM_WARPS)
    return out


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


# -- the row-parallel path (`launch_stable_topk_by_histogram`) -------------------------------------------------

@triton.jit
def _high_bits(row_ptr, i, s_col, ok):
    """The top 16 of the scores' order-preserving bits, as unsigned [0, 65536): a higher bin, a higher score."""
    u = _ordered_bits(row_ptr, i.to(tl.int64) * s_col, ok) ^ -2147483648
    return (u >> 16) & 0xFFFF


@triton.jit
def _high_histogram_kernel(s_ptr, state_ptr, length, s_row, s_col, st_row, CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    ok = i < length
    high = _high_bits(s_ptr + row * s_row, i, s_col, ok)
    tl.atomic_add(state_ptr + row * st_row + high, 1, mask=ok, sem="relaxed")


@triton.jit
def _high_bin_kernel(state_ptr, k, st_row, BINS: tl.constexpr, BLOCK: tl.constexpr):
    """B, the highest bin whose scores at or above it number at least k, and `above`, the scores above B."""
    row_ptr = state_ptr + tl.program_id(0).to(tl.int64) * st_row
    bins = tl.arange(0, BLOCK)
    above = tl.zeros([], dtype=tl.int32)  # scores in the blocks walked so far (all above this block)
    chosen = tl.full([], -1, dtype=tl.int32)
    chosen_above = tl.zeros([], dtype=tl.int32)
    for step in range(0, BINS // BLOCK):
        first = BINS - (step + 1) * BLOCK  # from the top block down
        counts = tl.load(row_ptr + first + bins)
        at_or_above = above + tl.sum(counts, axis=0) - tl.cumsum(counts, 0) + counts  # non-increasing in the bin
        reach = tl.sum((at_or_above >= k).to(tl.int32), axis=0)  # bins [first, first + reach) reach k
        here = (chosen < 0) & (reach > 0)
        bin_ = first + reach - 1
        chosen_above = tl.where(here, above + tl.sum(tl.where(bins > reach - 1, counts, 0), axis=0), chosen_above)
        chosen = tl.where(here, bin_, chosen)
        above += tl.sum(counts, axis=0)
    tl.store(row_ptr + BINS, chosen)
    tl.store(row_ptr + BINS + 1, chosen_above)


@triton.jit
def _collect_kernel(s_ptr, state_ptr, cand_ptr, out_ptr, length, s_row, s_col, st_row, c_row, o_row, o_col,
                    BINS: tl.constexpr, CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_state = state_ptr + row * st_row
    chosen = tl.load(row_state + BINS)
    i = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    ok = i < length
    high = _high_bits(s_ptr + row * s_row, i, s_col, ok)
    over = (ok & (high > chosen)).to(tl.int32)
    place = tl.atomic_add(row_state + BINS + 2, tl.sum(over, axis=0))  # this program's places among the above
    tl.store(out_ptr + row * o_row + (place + tl.cumsum(over, 0) - over).to(tl.int64) * o_col, i.to(tl.int64),
             mask=over == 1)
    tied = (ok & (high == chosen)).to(tl.int32)
    place = tl.atomic_add(row_state + BINS + 3, tl.sum(tied, axis=0))
    tl.store(cand_ptr + row * c_row + place + tl.cumsum(tied, 0) - tied, i, mask=tied == 1)


@triton.jit
def _candidate_keys(row_ptr, s_col, cand_row, j, ok):
    """The candidates' unique keys (int64, >= 0): the score's low 16 order-preserving bits, then 2^31 - 1 - index."""
    idx = tl.load(cand_row + j, mask=ok, other=0).to(tl.int64)
    low = (_ordered_bits(row_ptr, idx * s_col, ok) & 0xFFFF).to(tl.int64)
    return (low << 31) | (2147483647 - idx), idx


@triton.jit
def _key_radix_pass(row_ptr, s_col, cand_row, n, prefix, need, SHIFT: tl.constexpr, BLOCK: tl.constexpr):
    """`_radix_pass` over the candidates' keys: the byte at SHIFT of the need-th highest key."""
    offsets = tl.arange(0, BLOCK)
    bins = tl.arange(0, 256)
    counts = tl.zeros([256], dtype=tl.int32)
    for start in range(0, n, BLOCK):
        j = start + offsets
        ok = j < n
        key, idx = _candidate_keys(row_ptr, s_col, cand_row, j, ok)
        if SHIFT < 40:
            ok = ok & ((key >> (SHIFT + 8)) == (prefix >> (SHIFT + 8)))
        counts += tl.histogram(((key >> SHIFT) & 255).to(tl.int32), 256, mask=ok)
    at_or_above = tl.sum(counts, axis=0) - tl.cumsum(counts, 0) + counts
    byte = tl.sum((at_or_above >= need).to(tl.int32), axis=0) - 1
    above = tl.sum(tl.where(bins > byte, counts, 0), axis=0)
    return prefix | (byte.to(tl.int64) << SHIFT), need - above


@triton.jit
def _finish_kernel(s_ptr, state_ptr, cand_ptr, out_ptr, k, s_row, s_col, st_row, c_row, o_row, o_col,
                   BINS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = s_ptr + row * s_row
    row_state = state_ptr + row * st_row
    cand_row = cand_ptr + row * c_row
    out_row = out_ptr + row * o_row
    above = tl.load(row_state + BINS + 1)
    n = tl.load(row_state + BINS + 3)  # the scores in B: at least k - above
    prefix = tl.zeros([], dtype=tl.int64)
    need = k - above
    for shift in tl.static_range(40, -8, -8):  # TIE_KEY_BITS = 47: bytes at 40, 32, ..., 0
        prefix, need = _key_radix_pass(row_ptr, s_col, cand_row, n, prefix, need, shift, BLOCK)
    # prefix is now the (k - above)-th highest key; keys are unique, so the keys at or above it are the ones taken
    offsets = tl.arange(0, BLOCK)
    taken = above
    for start in range(0, n, BLOCK):
        j = start + offsets
        ok = j < n
        key, idx = _candidate_keys(row_ptr, s_col, cand_row, j, ok)
        chosen = (ok & (key >= prefix)).to(tl.int32)
        tl.store(out_row + (taken + tl.cumsum(chosen, 0) - chosen).to(tl.int64) * o_col, idx, mask=chosen == 1)
        taken += tl.sum(chosen, axis=0)
    tl.debug_barrier()  # the writes above (and the collect kernel's) are read back below
    j = tl.arange(0, BLOCK_K)
    live = j < k
    idx = tl.load(out_row + j * o_col, mask=live, other=0)
    keys = (_ordered_bits(row_ptr, idx * s_col, live).to(tl.int64) << 32) | (2147483647 - idx)
    keys = tl.sort(tl.where(live, keys, -9223372036854775807 - 1), descending=True)  # padding sorts last
    tl.store(out_row + j * o_col, 2147483647 - (keys - ((keys >> 32) << 32)), mask=live)
