"""The static decode layout: a layer's rows at a fixed capacity with device lengths, so that a decode step is the
same graph at every step (`torch.compile(fullgraph=True, dynamic=False)`, CUDA graphs).

A layer enters it for one decode loop (`KVBenchCache.make_static`: each `DynamicKVLayer` becomes a `StaticKVLayer`,
the same object, its type swapped) and leaves it when the loop ends (`make_dynamic`). Entering copies the layer once into buffers whose shape is fixed for the whole loop: per head
`tokens` rows of room past what it holds, the capacity rounded up to the next step of a geometric series
(`bucketed`) so that samples of similar length share a graph. Inside the loop nothing Python-side changes from one
step to the next:

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

Capacities. A compiled step is one graph per layout shape, and compiling one costs 13-41 s on a GPU at 8 layers
(a minute or more on a CPU), so capacities come from a geometric series: `CAPACITY_BUCKET` rows, then each step
`CAPACITY_GROWTH` times the one below (rounded up to a multiple of `CAPACITY_BUCKET`): 256, 512, 1K, 2K, ...
rows. A uniform layer's width is the smallest step at or above its tokens plus the loop's; a ragged layer's
total rows (the heads' tokens plus their room) and its view's width (the longest head plus room) are each the
smallest step at or above what they need. A sweep over prompt lengths then compiles one graph per doubling of
the length, not one per 256 rows: prompts of 1K to 8K tokens (plus their decode steps) fall into at most 5
capacities (2K, 4K, 8K, 16K, and 1K for a prompt that leaves room within 1,024 rows), 1K to 128K into 9.

The cost is memory held, not bytes read: a layer holds up to twice the rows it needs (a 4,200-token prompt
decoded for 64 steps holds 8,192 rows a head, 1.9x), plus what derived state keeps at the same capacity (page
summaries, SparQ's transposed keys). Attention reads only the rows below each head's `fill` where the backend
bounds its loop by the lengths (the split-K kernel on CUDA); elsewhere it masks the slots past `fill`, so the
slack is read there. The repeated-K/V baseline (`Method.repeats_kv`) reads its whole capacity on every device, as
RocketKV's gpt-fast baseline reads its `max_seq_length`, so its capacity takes linear 256-row steps instead
(`StaticKVLayer.enter`'s `tight`): it reads what the release reads, within 255 rows, at a graph per 256 rows of
prompt. The eager path (the default on CPU) never enters this layout: its records are unaffected.
If memory matters more than compile time, set `kvbench.cache.static.CAPACITY_GROWTH` before decoding (read at
every layout entry; it is no config key): 1.25 holds at most 25-40% slack rows (25% past 4K rows) for 2.5 times
as many graphs (22 capacities over 1K-128K instead of 9), 1 gives the linear 256-row steps (510 over 1K-128K).
Growth 2 keeps a 1K-8K sweep within 5 graphs; 1.5 can take 6. Compiled records'
`kv_capacity_bytes_end` shows the buffers held.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from transformers.cache_utils import Cache

from kvbench.cache.dynamic import DynamicKVLayer
from kvbench.cache.layer import KVLayer
from kvbench.core.contract import HeadView, Selection, Step, StepMethod
from kvbench.kernels.decode_attention import static_decode_attention
from kvbench.kernels.flash_decode import flash_decode, flash_decode_applies, flash_decode_selected
from kvbench.kernels.sparse_attention import topk_attention

CAPACITY_BUCKET = 256  # rows: the smallest capacity; every capacity is a multiple of it
CAPACITY_GROWTH = 2.0  # each capacity of the series is this many times the one below it (module docstring)


def bucketed(rows: int, bucket: int | None = None, growth: float | None = None) -> int:
    """The smallest capacity of the series at or above `rows`: `bucket` rows (default `CAPACITY_BUCKET`), then
    each capacity the one below times `growth` (default `CAPACITY_GROWTH`, read at the call), rounded up to a
    multiple of `bucket` and at least one `bucket` more. Growth 2: 256, 512, 1024, ...; growth 1: every multiple
    of `bucket` (linear steps)."""
    bucket = CAPACITY_BUCKET if bucket is None else bucket
    growth = CAPACITY_GROWTH if growth is None else growth
    if bucket < 1 or not growth >= 1:
        raise ValueError(f"capacity series: bucket {bucket} rows, growth {growth} (need bucket >= 1, growth >= 1)")
    if growth == 1:
        return max(1, -(-rows // bucket)) * bucket
    capacity = bucket
    while capacity < rows:
        capacity = max(capacity + bucket, -(-math.ceil(capacity * growth) // bucket) * bucket)
    return capacity


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
    # dense attention by the split-K kernel (`kernels.flash_decode`: CUDA), reading each head's first `fill` rows,
    # or by the PyTorch reference over the whole capacity, masked (CPU); decided once per loop, outside any trace
    flash_decode: bool = False

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


class StaticKVLayer(KVLayer):
    """A layer in the static layout (module docstring): buffers at a fixed capacity, lengths on the device (`static`,
    a `StaticRows`), a step's append, view and in-place eviction on them. A `DynamicKVLayer` becomes one for a
    decode loop (`enter`, by `KVBenchCache.make_static`) and turns back when it ends (`make_dynamic`, the device
    numbers read back once by the cache); the object stays the same."""

    is_static: ClassVar[bool] = True
    static: StaticRows

    @staticmethod
    def enter(layer: DynamicKVLayer, tokens: int, query_window: int, query_heads: int, ragged: bool = False,
              tight: bool = False) -> None:
        """Turn `layer`, a dynamic layer, into a static one (the same object) for a decode loop of up to `tokens`
        appends: one copy into buffers of a fixed capacity of the series (`bucketed`) that the layer holds alone,
        lengths on the device, the last `query_window` queries in a buffer of that size (empty entries at position
        -1), derived state at the same capacity. `ragged`: the flat layout even if every head holds as many tokens
        (a method whose layers may be ragged). `tight`: a uniform layer's capacity in linear steps of
        `CAPACITY_BUCKET` rows, not the geometric series, for an attention that reads every slot of its capacity,
        masked: the repeated-K/V baseline (`Method.repeats_kv`), which reads gpt-fast's exact `max_seq_length`
        (prompt plus new tokens) at every step, would read up to twice that in a geometric capacity and be
        timed slower than the release's; in linear steps it reads fewer than `CAPACITY_BUCKET` rows more
        (under 1.6% from 16K tokens), at the cost of a graph per 256 rows of prompt."""
        heads, device = len(layer.lens), layer.buffers["keys"].device
        uniform = not (ragged or layer.is_ragged)
        if uniform:
            width = bucketed(layer.lens[0] + tokens, growth=1 if tight else None)
            slack: list[int] = [width - layer.lens[0]] * heads
        else:  # fixed total rows, each head its own room: nothing padded to the longest head
            slack = [tokens] * heads
            slack[-1] += bucketed(sum(layer.lens) + heads * tokens) - (sum(layer.lens) + heads * tokens)
            width = bucketed(max(layer.lens) + tokens)
        layer._install(layer._compact(), list(layer.lens), slack=slack)
        starts = torch.tensor(layer.starts, dtype=torch.int64, device=device)
        fill = torch.tensor(layer.lens, dtype=torch.int64, device=device)
        row_head = row_slot = None
        if not uniform:
            caps = torch.tensor(layer.caps, dtype=torch.int64, device=device)
            row_head = torch.repeat_interleave(torch.arange(heads, device=device), caps)
            row_slot = torch.arange(row_head.shape[0], device=device) - starts[row_head]
        layer.__class__ = StaticKVLayer  # the same object: `cache.layers[i]` and every reference to it stay valid
        layer.static = StaticRows(
            starts=starts, fill=fill, next_slot=fill.clone(),
            peak=torch.tensor(layer.peak_len, dtype=torch.int64, device=device),
            evictions=torch.zeros((), dtype=torch.int64, device=device), width=width, uniform=uniform,
            row_bytes=2 * layer.head_dim * layer.buffers["keys"].element_size(), row_head=row_head, row_slot=row_slot,
            flash_decode=flash_decode_applies(layer.buffers["keys"]))
        for name, state in list(layer.derived.items()):
            if not hasattr(state, "make_static"):
                raise NotImplementedError(f"{type(state).__name__} (derived state {name!r}) has no static layout")
            layer.derived[name] = state.make_static(layer)
        if query_window:
            layer._static_queries(query_window, query_heads, device)

    def _static_queries(self, window: int, heads: int, device: torch.device) -> None:
        """The last `window` queries in a buffer of exactly `window` entries, oldest first (empty: position -1),
        the ring's next write at the oldest."""
        kept = 0 if self.queries is None else min(window, self.queries.shape[1])
        queries = torch.zeros(heads, window, self.head_dim, dtype=self.dtype, device=device)
        positions = torch.full((window,), -1, dtype=torch.int32, device=device)
        if kept:
            queries[:, window - kept:] = self.queries[:, -kept:]
            positions[window - kept:] = self.query_positions[-kept:]
        self.queries, self.query_positions = queries, positions
        self.query_slot = torch.zeros((), dtype=torch.int64, device=device)

    def _store(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """A decode step's token written at each head's `next_slot` (an emptied slot, or the next free one)."""
        st, heads = self.static, self.num_heads
        if key_states.shape[2] != 1:
            raise RuntimeError("a static layer takes one token per step")
        rows = st.starts + st.next_slot
        position = self.cache.static_position
        for name, buf in self.buffers.items():
            if name == "keys":
                new = key_states[0, :, 0]
            elif name == "values":
                new = value_states[0, :, 0]
            elif name == "positions":
                new = position.to(buf.dtype).expand(heads)
            else:  # method token state starts at zero
                new = buf.new_zeros(heads, *buf.shape[1:])
            buf.index_copy_(0, rows, new)
        for state in self.derived.values():
            state.append_static(self, key_states[0, :, 0], value_states[0, :, 0])
        st.fill.add_((st.next_slot == st.fill).to(st.fill.dtype))
        st.next_slot.copy_(st.fill)
        st.peak.copy_(torch.maximum(st.peak, st.fill.max()))
        self.cache.static_counters.add(torch.tensor(heads * st.row_bytes, device=st.fill.device))
        self.fresh = True
        return key_states, value_states

    def field(self, name: str) -> torch.Tensor:
        """A per-token field over the whole capacity: `[H, width, ...]` views (`[1, H, width, D]` for keys and
        values) on a uniform layer, the flat buffer `[R, ...]` on a ragged one."""
        buf = self.buffers[name]
        if not self.static.uniform:
            return buf
        view = buf.view(self.num_heads, self.static.width, *buf.shape[1:])
        return view[None] if name in ("keys", "values") else view

    def lengths(self) -> list[int]:
        raise RuntimeError("a static layer's lengths are on the device (`head_view().lengths`) until make_dynamic")

    def held_tokens(self) -> torch.Tensor:
        """Tokens held over all heads: a 0-d device tensor."""
        return self.static.fill.sum()

    def physical_length(self) -> int:
        """The fixed capacity: the width of the `[H, width]` view."""
        return self.static.width

    def head_view(self) -> HeadView:
        """`[H, width, D]` over the capacity, with `valid` (the slots holding tokens) and the device `lengths`."""
        st = self.static
        valid = st.valid()
        if st.uniform:
            heads, width = self.num_heads, st.width
            keys, values = (self.buffers[n].view(heads, width, -1) for n in ("keys", "values"))
            positions = self.buffers["positions"].view(heads, width)
        else:
            rows = st.padded_rows(self.buffers["keys"].shape[0])
            keys, values = self.buffers["keys"][rows], self.buffers["values"][rows]
            positions = torch.where(valid, self.buffers["positions"][rows], -1)
        return HeadView(keys, values, positions, valid, lengths=st.fill)

    def remember_queries(self, query: torch.Tensor, window: int) -> None:
        """The step's queries `[H_q, 1, D]` overwrite the oldest entry of the static query window, a ring whose
        oldest entry is at `query_slot`: written where they go, they fuse into the kernels that compute them
        (shifting the window by a `cat` and a copy back was 3 kernels a layer of RocketKV's compiled step on a GPU,
        `scripts/count_step_kernels.py`); `make_dynamic` puts the window back in order, oldest first."""
        slot = self.query_slot.view(1)
        self.queries.index_copy_(1, slot, query)
        self.query_positions.index_copy_(0, slot, self.cache.static_position.to(self.query_positions.dtype))
        self.query_slot.copy_((self.query_slot + 1) % self.queries.shape[1])

    def recent_queries(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The last `count` queries the layer attended with, oldest first, `[H_q, count, D]`, and their positions:
        read out of the ring in that order."""
        if self.query_slot is None:
            return self.queries[:, -count:], self.query_positions[-count:]
        return _ring_in_order(self.queries, self.query_positions, self.query_slot, count)

    def dense_decode(self, q: torch.Tensor, scaling: float, repeats_kv: bool = False) -> torch.Tensor:
        """Attention over the fixed capacity with the device lengths. [H_kv, G, D]."""
        st = self.static
        if repeats_kv:
            # RocketKV's and gpt-fast's Full-KV baseline, kept as it is measured there: the capacity copied to every
            # query head and attended whole, masked (math attention; never the split-K kernel)
            copies = q.shape[1]
            view = self.head_view()
            keys, values = (t.repeat_interleave(copies, dim=0) for t in (view.keys, view.values))
            fill = st.fill.repeat_interleave(copies)
            return static_decode_attention(q.reshape(-1, 1, q.shape[-1]), keys.flatten(0, 1), values.flatten(0, 1),
                                           scaling, fill, st.width, None, None).view(q.shape)
        if st.flash_decode:  # CUDA: each head's held rows only, read once per KV group
            return flash_decode(q, self.buffers["keys"], self.buffers["values"], st.starts, st.fill, scaling)
        return static_decode_attention(q, self.buffers["keys"], self.buffers["values"], scaling, st.fill,
                                       st.width if st.uniform else None, st.row_head, st.row_slot)

    def attend_selected(self, q: torch.Tensor, view: HeadView, idx: torch.Tensor, scaling: float) -> torch.Tensor:
        st = self.static
        if st.flash_decode:  # CUDA: the selected slots read where they are, by the split-K operator (one graph node)
            return flash_decode_selected(q, self.buffers["keys"], self.buffers["values"], st.starts, st.fill, idx,
                                         scaling)
        return topk_attention(q, view.keys, view.values, idx, scaling, view.valid)

    def account_selected_step(self, elements: Any, recall: Any, attended: Any, selection: Selection,
                              view: HeadView) -> None:
        """On the device: a selection of at least every token held is full attention, which the eager path runs
        (and accounts) densely; counted the same way here, where the choice is data, not Python."""
        selective = view.lengths.max() > selection.idx.shape[-1]
        held = self.held_tokens()
        elements = torch.where(selective, elements, 2 * self.head_dim * held)
        attended = torch.where(selective, attended, held / self.num_heads)
        self.cache.stats.add(self, elements, recall, attended, selection.moved_bytes, selection.extra,
                             recall_counts=selective)

    def observe(self, method: StepMethod, queries: torch.Tensor, step: Step) -> None:
        """The method's observation of a decode step's query `[H_q, 1, D]`, in fixed shapes (`Method.observe_step`)."""
        method.observe_step(self, queries, step)

    def evict(self, method: StepMethod, step: Step) -> None:
        """A decode step's eviction: every head over the number of tokens it keeps loses the slot of its lowest
        score (`Method.decode_eviction_scores`), emptied in place (`static_evict`). A decode step adds one token per
        head, so after the first decode step of the loop (run eagerly, see `Session`) a head is never more than one
        token over."""
        scores, keep = method.decode_eviction_scores(self, self.budget, step)
        st = self.static
        slot = scores.float().masked_fill(~st.valid(), float("inf")).argmin(dim=-1)
        self.static_evict(slot, st.fill > keep)

    def static_evict(self, slot: torch.Tensor, evict: torch.Tensor) -> None:
        """Empty slot `slot[h]` of every head with `evict[h]` (one token per head at most): its position becomes
        -1 and the next token is written there, so nothing else moves."""
        st = self.static
        rows = st.starts + slot
        positions = self.buffers["positions"]
        positions.index_copy_(0, rows, torch.where(evict, -1, positions.index_select(0, rows)).to(positions.dtype))
        st.next_slot.copy_(torch.where(evict, slot, st.fill))
        removed = evict.sum()
        st.evictions.add_((removed > 0).to(st.evictions.dtype))
        self.cache.static_counters.add(-removed * st.row_bytes)

    def static_add_token_state(self, name: str, delta: torch.Tensor) -> None:
        """Add `delta` [H, width] to the token state `name` of the slots holding tokens, in place (the layer owns
        its buffers while static; others are added nothing)."""
        st, buf = self.static, self.buffers[name]
        delta = delta.masked_fill(~st.valid(), 0).to(buf.dtype)
        if st.uniform:
            buf.view(self.num_heads, st.width).add_(delta)
        else:
            buf.index_add_(0, st.padded_rows(buf.shape[0]).flatten(), delta.flatten())

    def static_host_numbers(self) -> list[torch.Tensor]:
        """What `make_dynamic` reads back, as 1-d int64 tensors: fill, next_slot, [peak, evictions]."""
        st = self.static
        return [st.fill, st.next_slot, torch.stack([st.peak, st.evictions])]

    def make_dynamic(self, fill: list[int], next_slot: list[int], peak: int, evictions: int) -> None:
        """Leave the static layout after its decode loop (the device numbers read back once, by the cache): the layer
        is a `DynamicKVLayer` again. A layer that evicted while decoding is compacted into position order, as the
        eager layout keeps it."""
        st = self.static
        del self.static
        self.__class__ = DynamicKVLayer
        self.peak_len, self.evictions = max(self.peak_len, peak), self.evictions + evictions
        held = [f - (s != f) for f, s in zip(fill, next_slot)]  # an eviction's emptied slot is not refilled yet
        if evictions:
            positions = self.buffers["positions"]
            rows = (st.starts[:, None] + st.slots()[None, :]).clamp(max=positions.shape[0] - 1)
            pos = positions[rows].long()
            taken = (st.slots()[None, :] < st.fill[:, None]) & (pos >= 0)
            order = torch.where(taken, pos, torch.iinfo(torch.int64).max).argsort(dim=-1, stable=True)
            kept = torch.cat([rows[h, order[h, :n]] for h, n in enumerate(held)])
            self._install({name: t.index_select(0, kept) for name, t in self.buffers.items()}, held)
            self.derived = {name: k for name, state in self.derived.items()
                            if (k := getattr(state, "kept", lambda layer: None)(self)) is not None}
        else:
            self.lens, self.claimed = list(held), list(held)
        self.derived = {name: state.make_dynamic(self) for name, state in self.derived.items()}
        if self.query_slot is not None:  # the ring back in order, oldest first
            self.queries, self.query_positions = _ring_in_order(self.queries, self.query_positions, self.query_slot,
                                                                self.queries.shape[1])
            self.query_slot = None
        if self.query_positions is not None and bool((self.query_positions < 0).any()):
            kept_queries = self.query_positions >= 0
            self.queries = self.queries[:, kept_queries].clone() if bool(kept_queries.any()) else None
            self.query_positions = self.query_positions[kept_queries].clone() if self.queries is not None else None

    def clone_into(self, cache: Cache) -> KVLayer:
        raise RuntimeError("a layer in the static decode layout is not cloned (make_dynamic first)")


def _ring_in_order(queries: torch.Tensor, positions: torch.Tensor, slot: torch.Tensor,
                   count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The last `count` entries of the static query window, a ring whose oldest entry is at `slot`, oldest first."""
    window = queries.shape[1]
    order = (torch.arange(window - count, window, device=slot.device) + slot) % window
    return queries.index_select(1, order), positions.index_select(0, order)
