"""MInference's sparse prefill (Jiang et al. 2024, "MInference 1.0"; microsoft/MInference): the prompt's first
forward attends each query head only to the "vertical" columns and "slash" diagonals its last queries point at.
CTKVR Table 3 prefills with it before Full-KV and CTKVR decoding (`engine.prefill_attention=minference`).

Per query head (MInference repeats the KV heads to the query heads), as the authors' `vertical_and_slash_kernel`
(minference/modules/minference_forward.py) estimates them:

- the last `last_q` = min(64, L) queries attend (causally) to every key, softmax in fp32;
- vertical: their attention summed per key, the first 30 keys forced in (+inf), the top `vertical_size` keys;
- slash: their attention summed per diagonal (offset = query position - key position), the 100 nearest
  diagonals forced in, the top `slash_size` diagonals, ordered as the authors' `sum_all_diagonal_matrix` orders
  them (so that `topk` breaks ties alike);
- sizes: each head's pattern (default `("vertical_and_slash", 1000, 6096)`, the authors' default for a head
  without a searched pattern), times `ratio` (their `minference_ratio`), then clamped to
  [30, L] and [50, L] as theirs are.

The attention is what their sparse kernel computes from those indices (`convert_vertical_slash_indexes` in
csrc/vertical_slash_index.cu, then a block-sparse flash attention with causal masking): for each block of 64
queries ending at E, each diagonal o becomes a range of 64 keys ending at E - o (clamped to start at 0), the
ranges are merged walking the diagonals from the farthest in, a range that a next diagonal extends growing by
whole 64-key steps (so a merged range can cover up to 63 keys more than its diagonals' union), and the vertical
keys outside the ranges are attended as single columns. `block_coverage` computes the same ranges without the
per-diagonal loop (docstring there), and `kernel_ranges` is the kernel's loop transcribed, the test oracle.
Scores in fp32, softmax over the covered causal keys, the output in the query's dtype.

What this is not: MInference's speed. The attention here is the dense computation masked to the pattern (an
accuracy emulation, with the pattern search's cost); its prefill time says nothing of their kernels'. Only the
vertical-and-slash pattern is implemented: a pattern file naming `stream_llm` or `block_sparse` heads is
refused. The offline per-head pattern search is not run: heads take `pattern_file`'s patterns, or the default.

The pattern estimate against the release's on the same tensors: docs/fidelity.md.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import torch

from kvbench.core.checks import is_int
from kvbench.core.errors import KVBenchError

BLOCK = 64  # the sparse kernel's query and key blocks (convert_vertical_slash_indexes_64x64)
LAST_Q = 64  # queries that estimate the pattern
FIRST_COLUMNS = 30  # keys always kept (vertical[..., :30] = inf)
LOCAL_DIAGONALS = 100  # diagonals always kept (slash[..., -100:] = inf)
DEFAULT_PATTERN = ("vertical_and_slash", 1000, 6096)
ROWS_PER_CHUNK = 1024  # queries whose masked scores are computed at once


@dataclasses.dataclass(frozen=True)
class MInference:
    """The prefill attention of `engine.prefill_attention=minference` (`engine.minference.*`)."""

    vertical_size: int = DEFAULT_PATTERN[1]
    slash_size: int = DEFAULT_PATTERN[2]
    ratio: float = 1.0
    starting_layer: int = 0
    # per layer, {query head: (type, vertical, slash)}, from the authors' searched-pattern JSON
    patterns: tuple[dict[int, tuple[str, int, int]], ...] = ()

    @classmethod
    def from_settings(cls, settings: dict[str, Any]) -> "MInference":
        """From `engine.minference`, each setting checked (one line naming it): positive integer sizes, the
        slash at least the 100 diagonals the authors always keep (so that a block's own diagonal is one), a
        positive ratio, a starting layer >= 0, a pattern file that exists and names vertical-and-slash heads."""
        settings = dict(settings)
        pattern_file = settings.pop("pattern_file", None)
        unknown = set(settings) - {"vertical_size", "slash_size", "ratio", "starting_layer"}
        if unknown:
            raise KVBenchError(f"engine.minference: unknown setting(s) {sorted(unknown)}; known: vertical_size, "
                               "slash_size, ratio, starting_layer, pattern_file")
        for key, low in (("vertical_size", 1), ("slash_size", 1), ("starting_layer", 0)):
            if key in settings and (not is_int(settings[key]) or settings[key] < low):
                raise KVBenchError(f"engine.minference.{key} must be an integer >= {low}, got {settings[key]!r}")
        ratio = settings.get("ratio", cls.ratio)
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or ratio <= 0:
            raise KVBenchError(f"engine.minference.ratio must be a positive number, got {ratio!r}")
        slash = int(settings.get("slash_size", cls.slash_size) * ratio)
        if slash < LOCAL_DIAGONALS:
            raise KVBenchError(f"engine.minference.slash_size x ratio = {slash}: at least {LOCAL_DIAGONALS} (the "
                               "nearest diagonals MInference always keeps)")
        return cls(**settings, patterns=load_patterns(pattern_file) if pattern_file else ())

    def head_sizes(self, layer: int, head: int, length: int) -> tuple[int, int]:
        """(vertical, slash) of a query head at a prompt of `length` tokens, as the authors size them."""
        _, vertical, slash = (self.patterns[layer].get(head, DEFAULT_PATTERN) if layer < len(self.patterns)
                              else (None, self.vertical_size, self.slash_size))
        vertical, slash = int(vertical * self.ratio), int(slash * self.ratio)
        return min(length, max(vertical, 30)), min(length, max(slash, 50))

    def __call__(self, layer: int, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 scaling: float) -> torch.Tensor:
        """The prompt's causal attention `[1, H_q, L, D]` of query `[1, H_q, L, D]` over keys and values
        `[1, H_kv, L, D]`; layers below `starting_layer` attend densely, as the authors' do."""
        if layer < self.starting_layer:
            return torch.nn.functional.scaled_dot_product_attention(query, keys, values, scale=scaling,
                                                                    is_causal=True, enable_gqa=True)
        heads, length = query.shape[1], query.shape[2]
        group = heads // keys.shape[1]
        out = torch.empty_like(query)
        for head in range(heads):
            q, k, v = query[0, head].float(), keys[0, head // group].float(), values[0, head // group].float()
            vertical, slash = self.head_sizes(layer, head, length)
            columns, diagonals = estimate_vertical_slash(q[-min(LAST_Q, length):], k, scaling, vertical, slash)
            out[0, head] = sparse_attention(q, k, v, scaling, columns, diagonals).to(query.dtype)
        return out


def load_patterns(path: str | Path) -> tuple[dict[int, tuple[str, int, int]], ...]:
    """The authors' searched patterns (`minference/configs/*_best_pattern.json`: a list per layer of
    {head: [type, vertical, slash, score]}); only vertical_and_slash heads run here."""
    file = Path(path)
    if not file.is_file():
        raise KVBenchError(f"engine.minference.pattern_file={path}: no such file")
    layers = []
    for index, layer in enumerate(json.loads(file.read_text())):
        heads = {}
        for head, (kind, vertical, slash, *_) in layer.items():
            if kind != "vertical_and_slash":
                raise KVBenchError(f"{path}: layer {index} head {head} has pattern {kind!r}; kvbench implements "
                                   "MInference's vertical_and_slash heads only")
            heads[int(head)] = (kind, int(vertical), int(slash))
        layers.append(heads)
    return tuple(layers)


def estimate_vertical_slash(q_last: torch.Tensor, keys: torch.Tensor, scaling: float, vertical: int,
                            slash: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys (`vertical`, ascending) and the diagonal offsets (`slash`, descending) of one query head, from
    its last queries `q_last` `[n, D]` over `keys` `[L, D]` (fp32)."""
    length, n = keys.shape[0], q_last.shape[0]
    logits = (q_last @ keys.T) * scaling
    causal = torch.arange(n)[:, None] >= torch.arange(n)[None, :]
    logits[:, length - n:] = logits[:, length - n:].masked_fill(~causal, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    columns = probs.sum(dim=0)
    columns[:FIRST_COLUMNS] = float("inf")
    # diagonal sums indexed as the authors' sum_all_diagonal_matrix(...)[..., :-last_q + 1]: index (L - 1) - offset
    offsets = (length - n + torch.arange(n))[:, None] - torch.arange(length)[None, :]
    past = offsets >= 0
    diagonals = torch.zeros(length).index_add_(0, (length - 1 - offsets)[past], probs[past])
    diagonals[-LOCAL_DIAGONALS:] = float("inf")
    chosen_columns = columns.topk(vertical).indices.sort().values
    chosen_offsets = ((length - 1) - diagonals.topk(slash).indices).sort(descending=True).values
    return chosen_columns, chosen_offsets


def kernel_ranges(offsets: list[int], columns: list[int], end: int) -> tuple[list[tuple[int, int]], list[int]]:
    """The sparse kernel's key ranges and single columns of the query block ending at `end`: the loop of
    `convert_vertical_slash_indexes_kernel` transcribed (offsets descending, columns ascending). The test
    oracle of `block_coverage`."""
    ranges: list[tuple[int, int]] = []
    kept_columns: list[int] = []
    s = v = 0
    v_idx = columns[v] if v < len(columns) else end + BLOCK
    v += v < len(columns)
    s_idx = offsets[s] if s < len(offsets) else -1
    s += s < len(offsets)
    while s_idx >= end and s < len(offsets):
        s_idx = offsets[s]
        s += 1
    s_idx = end + BLOCK if s_idx >= end else max(end - s_idx, BLOCK)
    start, stop = s_idx - BLOCK, s_idx
    while True:
        if v_idx < stop:
            if v_idx < start:
                kept_columns.append(v_idx)
            if v < len(columns):
                v_idx = columns[v]
                v += 1
            else:
                v_idx = end + BLOCK
        else:
            if s < len(offsets):
                s_idx = max(end - offsets[s], BLOCK)
                s += 1
            else:
                ranges.append((start, stop))
                break
            if s_idx > stop + BLOCK:
                ranges.append((start, stop))
                start, stop = s_idx - BLOCK, s_idx
            elif s_idx > stop:
                stop += BLOCK
    return ranges, kept_columns


def block_coverage(offsets: torch.Tensor, columns: torch.Tensor, ends: torch.Tensor, length: int) -> torch.Tensor:
    """Which keys `[B, length]` (bool) the kernel attends for the query blocks ending at `ends` `[B]` (before
    the causal mask): `kernel_ranges`' ranges and columns, computed in distance (end - key) instead of walking
    every diagonal for every block. In distance, a merged range is a chain: it starts at a diagonal x (for
    the block ending at E: E - 64 when a diagonal lies within 64 of E, whose range is clamped to keys
    [0, 64), else the farthest diagonal nearer than that), covers distances (x - 64 K, x + 64] where K is
    how many consecutive 64-wide windows [x - 64 (k + 1), x - 64 k) below x hold a diagonal, and the next
    chain starts at the farthest diagonal beyond the first empty window. The kernel's loop does exactly this
    (a diagonal nearer than the range's far end by up to 64 extends it by 64, a farther one starts a new range,
    one inside it does nothing), and every block shares the chains below its first one, so each block follows
    its chain of chains, all blocks at once. Columns: every vertical key before the last range's end (those
    inside a range are attended either way)."""
    device = ends.device
    ascending = offsets.flip(0)
    present = torch.zeros(length + BLOCK + 1, dtype=torch.int64, device=device)
    present[offsets] = 1
    below = torch.cat([present.new_zeros(1), present.cumsum(0)])  # below[d] = diagonals at distances < d

    def held(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:  # diagonals in [lo, hi)
        return below[hi.clamp(0, length + BLOCK)] - below[lo.clamp(0, length + BLOCK)]

    # run[e]: consecutive windows [e - 64 (k + 1), e - 64 k) holding a diagonal, k = 0, 1, ... (e = 0 .. length + 64)
    top = length + BLOCK
    e = torch.arange(top + 1, device=device)
    full = held(e - BLOCK, e) > 0
    padded = -(-(top + 1) // BLOCK) * BLOCK
    lanes = torch.zeros(padded, dtype=torch.bool, device=device)
    lanes[: top + 1] = full
    lanes = lanes.view(-1, BLOCK)  # [window, residue]: e = BLOCK * window + residue
    index = torch.arange(lanes.shape[0], device=device)[:, None].expand_as(lanes)
    last_empty = torch.where(lanes, torch.full_like(index, -1), index).cummax(dim=0).values
    run = (index - last_empty).reshape(-1)[: top + 1]

    def farthest_below(limit: torch.Tensor) -> torch.Tensor:  # the farthest diagonal < limit, or -1
        position = torch.searchsorted(ascending, limit) - 1
        return torch.where(position >= 0, ascending[position.clamp(min=0)], torch.full_like(limit, -1))

    near = held(ends - BLOCK, ends) > 0
    current = torch.where(near, ends - BLOCK, farthest_below(ends - BLOCK))
    edges = torch.zeros(len(ends), length + 1, dtype=torch.int32, device=device)
    rows = torch.arange(len(ends), device=device)
    last_end = ends + BLOCK  # where the last range ends (no diagonal at all: the kernel's range past the block)
    active = current >= 0
    while bool(active.any()):
        x = current.clamp(min=0)
        steps = run[x]
        lo = (ends - x - BLOCK).clamp(0, length)
        hi = ends - x + BLOCK * steps
        edges[rows[active], lo[active]] += 1
        edges[rows[active], hi.clamp(0, length)[active]] -= 1
        last_end = torch.where(active, hi, last_end)
        current = torch.where(active, farthest_below(x - BLOCK * steps), current)
        active = active & (current >= 0)
    covered = edges.cumsum(dim=1)[:, :length] > 0
    # the kernel takes the vertical keys it meets before its last range ends (those past it, only where no
    # diagonal lies near the block, are dropped)
    covered |= (torch.zeros(length, dtype=torch.bool, device=device).index_fill_(0, columns, True)[None, :]
                & (torch.arange(length, device=device)[None, :] < last_end[:, None]))
    return covered


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float, columns: torch.Tensor,
                     offsets: torch.Tensor) -> torch.Tensor:
    """One query head's causal attention `[L, D]` (fp32) over the keys the kernel covers, a chunk of query blocks
    at a time (the masked scores of `ROWS_PER_CHUNK` queries at once)."""
    length = q.shape[0]
    out = torch.empty_like(q)
    blocks_per_chunk = max(1, ROWS_PER_CHUNK // BLOCK)
    for first in range(0, math.ceil(length / BLOCK), blocks_per_chunk):
        blocks = torch.arange(first, min(first + blocks_per_chunk, math.ceil(length / BLOCK)))
        ends = (blocks + 1) * BLOCK
        covered = block_coverage(offsets, columns, ends, length)  # [b, L]
        start, stop = int(blocks[0]) * BLOCK, min(int(ends[-1]), length)
        positions = torch.arange(start, stop)
        mask = covered.repeat_interleave(BLOCK, dim=0)[: stop - start]
        mask &= torch.arange(length)[None, :] <= positions[:, None]
        scores = (q[start:stop] @ k.T) * scaling
        out[start:stop] = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v
    return out
