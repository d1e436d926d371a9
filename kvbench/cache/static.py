"""The static decode layout: a layer's rows at a fixed capacity with device lengths, so that a decode step is the
same graph at every step (`torch.compile(fullgraph=True, dynamic=False)`, CUDA graphs).

A `KVLayer` enters it for one decode loop (`KVBenchCache.make_static`) and leaves it when the loop ends
(`make_dynamic`). Entering copies the layer once into buffers whose shape is fixed for the whole loop: per head
`tokens` rows of room past what it holds, the capacity rounded up to whole `CAPACITY_BUCKET`s so that samples
of similar length share a graph. Inside the loop nothing Python-side changes from one step to the next:

- where each head's rows are (`starts`) and how many it holds (`fill`) are device tensors; the only Python
  numbers a step reads are the layout's shape (`width`, `uniform`), fixed for the loop;
- an append writes one row per head at `next_slot` (`index_copy_`), so it never copies the layer;
- decode-time eviction (one token per head and step, `decode_every=1`) marks the evicted slot empty
  (position -1) and the next append overwrites it: rows are no longer in position order, which is why
  everything that means "the most recent tokens" reads `positions`, not the row order;
- attention reads the capacity and masks the slots at or past `fill` (`valid`);
- byte accounting and the decode statistics are device counters (`StaticCounters`, `DecodeStats`), read once
  when the loop ends.

Uniform layers (every head the same length: full cache, uniform eviction, a per-query-head split) are
`[H, width, D]` views of the flat buffers. Ragged layers (Ada-KV, DuoAttention) keep the flat layout with
per-head capacities: the total rows are fixed (their sum, bucketed), so no head is padded to the longest; their
attention reads each row once (`kernels.decode_attention.static_decode_attention`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CAPACITY_BUCKET = 256  # rows: capacities are rounded up to this, so samples of similar length share a graph


def bucketed(rows: int, bucket: int = CAPACITY_BUCKET) -> int:
    return -(-rows // bucket) * bucket


@dataclass
class StaticRows:
    """Where a static layer's heads keep their rows. Head h owns buffer rows `starts[h] .. starts[h] +
    caps[h]`; its slot s is row `starts[h] + s`; slots `0 .. fill[h] - 1` hold tokens when it attends."""

    starts: torch.Tensor  # [H] int64
    fill: torch.Tensor  # [H] int64: the slots holding tokens (every one of them, when the head attends)
    next_slot: torch.Tensor  # [H] int64: where the next token goes (fill, or the slot an eviction emptied)
    peak: torch.Tensor  # 0-d int64: the most tokens any head held (the layer's `peak_len`)
    evictions: torch.Tensor  # 0-d int64: eviction events that removed a token
    width: int  # slots of the [H, width] view: the uniform capacity, or the largest ragged one
    uniform: bool  # heads evenly strided at `width` rows: the buffers are [H, width, ...] views
    row_bytes: int  # bytes of one token's key and value
    row_head: torch.Tensor | None = None  # ragged: [R] the head owning each buffer row
    row_slot: torch.Tensor | None = None  # ragged: [R] its slot in that head (rows past the last head: >= cap)

    def slots(self) -> torch.Tensor:
        return torch.arange(self.width, device=self.fill.device)

    def valid(self) -> torch.Tensor:
        """[H, width] bool: the slots holding tokens (at attention time every slot below `fill`)."""
        return self.slots()[None, :] < self.fill[:, None]

    def padded_rows(self, total_rows: int) -> torch.Tensor:
        """[H, width] buffer rows of each head's slots (a ragged layer's padding clamped to the last row)."""
        return (self.starts[:, None] + self.slots()[None, :]).clamp(max=total_rows - 1)

    def valid_rows(self) -> torch.Tensor:
        """Ragged: [R] bool, the buffer rows holding tokens."""
        return self.row_slot < self.fill[self.row_head]


@dataclass
class StaticCounters:
    """A static cache's byte accounting on the device: K/V bytes held now and at most (`KVBenchCache._account`)."""

    kv_bytes: torch.Tensor  # 0-d int64
    kv_peak_bytes: torch.Tensor  # 0-d int64

    def add(self, delta: torch.Tensor) -> None:
        self.kv_bytes.add_(delta)
        self.kv_peak_bytes.copy_(torch.maximum(self.kv_peak_bytes, self.kv_bytes))
