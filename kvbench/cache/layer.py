"""`KVLayer`: one layer of the KV cache, a per-head row store in which every KV head may hold its own tokens.

Storage (batch size 1, as in the Ada-KV and RocketKV reference code): every per-token field of a layer
(keys, values, positions, a method's token state) is one flat row buffer `[R, ...]`; head h's tokens are
rows `starts[h] .. starts[h] + len_h`, and the rows up to the next head's start are slack for appends.

- *uniform*: every head holds the same number of tokens and the heads are evenly strided, so `keys`/
  `values` are `[1, H, L, D]` views and `positions` is `[H, L]`. Full cache and uniform eviction
  (StreamingLLM, SnapKV, KeyDiff, ...) live here, and the uncompressed attention path is exactly the stock
  SDPA call (on a strided view: bitwise the same as on a contiguous copy).
- *ragged*: heads hold different numbers of tokens (Ada-KV). `keys`/`values` are the flat buffers with
  `starts` and `lens` (the official Ada-KV layout, `cu_seqlens` style), so evicted tokens are really
  freed rather than padded.

Appending a token writes one row per head into the slack: amortised O(1), never a copy of the layer. When
a head has no room, the layer is copied once into buffers with slack (a quarter of the longest head, or
what `reserve` asked for: the engine reserves the tokens it is about to decode). Eviction and rollback
gather the kept rows with `index_select` into new compact buffers, so the old storage is freed (a slice
would keep it alive); one that drops only a few rows per head moves the kept rows in place instead.
`kv_bytes` counts the tokens held, `kv_capacity_bytes` the buffers with their slack.

`H` is the model's KV heads, unless a method split every KV head into one copy per query head (SnapKV per
query head, RocketKV's baseline): `retain` with G index lists per KV head does that, new tokens are then
appended to every copy, and the attention paths see a GQA group of 1. The storage that costs is counted.

Per-token state travels with the tokens. `positions` (each stored token's logical position; RoPE is
already applied to the keys) and a method's `token_state` tensors (H2O's accumulated attention) share one
row layout, so eviction, appends and rollback move all of them with one set of row indices and no method
keeps a side table that could drift from the cache. A layer also keeps the last `Step.query_window`
queries it attended with (`queries`, `query_positions`): the observation window of SnapKV-like scores,
whether eviction runs at the end of a segment, after a prefill block or during decoding.

Derived state a selection method reads (page summaries, SparQ's transposed keys) is `derived`: objects the
method builds (`Method.build_derived`) when the segment ends; the cache hands every append and rollback to them
(`append(layer, n)` / `truncate(layer)` return the updated object) and drops them when an eviction changes the
rows, after which the method rebuilds them. An object that updates in place (page summaries, CTKVR's index)
has a `fork()`, which a clone calls, so that a clone's appends never reach the layer it was cloned from.

Three lengths, each with one meaning: `seen`, the logical tokens appended so far (the next token's position;
`get_seq_length()` reports it to transformers, so its default positions stay right after eviction);
`lens[h]` (`lengths()`), the tokens head h stores now; `physical_length()`, the longest head's, `max(lens)`,
the width of a padded view.

A prefill snapshot and a teacher-forcing fork share buffers with the cache they were cloned from. That is
safe because a shared row is never rewritten, and an append writes into slack only where no layer sharing
the buffers has written past its own length (`claimed`); otherwise it copies (copy on write). A layer that
holds its buffers alone (`row_sharers`) rewrites them in place on a small eviction, a decode step's (any
eviction method with `decode_every`, DuoAttention's sliding window, KeyDiff's block loop): the kept rows move
down within each head's rows, so nothing is copied whole.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import MutableMapping
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvbench.cache.static import StaticRows, bucketed
from kvbench.core.contract import HeadView


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


FIXED_FIELDS = ("keys", "values", "positions")


GROWTH = 0.25  # slack added when an append finds no room: a quarter of the longest head (amortised O(1))


MIN_SLACK = 16


def growth_slack(longest: int) -> int:
    """Free rows per head a layer whose longest head holds `longest` tokens gets when it grows."""
    return max(MIN_SLACK, math.ceil(GROWTH * longest))


class TokenState(MutableMapping):
    """A layer's method-owned per-token tensors by name: `[H, L]` on a uniform layer, flat `[sum_h len_h]`
    (head after head) on a ragged one. Setting one installs a new buffer in the layer's row layout (clones
    keep the old one); reading a ragged one gathers its rows."""

    def __init__(self, layer: "KVLayer"):
        self.layer = layer

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in FIXED_FIELDS or name not in self.layer.buffers:
            raise KeyError(name)
        return self.layer.field(name)

    def __setitem__(self, name: str, value: torch.Tensor) -> None:
        if name in FIXED_FIELDS:
            raise KeyError(f"{name} is not method state")
        self.layer.set_field(name, value)

    def __delitem__(self, name: str) -> None:
        if name in FIXED_FIELDS or name not in self.layer.buffers:
            raise KeyError(name)
        del self.layer.buffers[name]

    def __iter__(self):
        return (name for name in list(self.layer.buffers) if name not in FIXED_FIELDS)

    def __len__(self) -> int:
        return sum(1 for _ in self)


class KVLayer(CacheLayerMixin):
    is_compileable = False  # a True value makes generate() build 4D masks and auto-compile
    is_sliding = False
    is_croppable = False

    def __init__(self, layer_idx: int, cache: Cache):
        # not CacheLayerMixin.__init__: it assigns `keys`/`values`, which are views of `buffers` here
        self.is_initialized = False
        self.layer_idx = layer_idx
        self.cache = cache
        # flat row buffers `[R, ...]`, one per per-token field (keys, values, positions, method state); head h
        # holds rows starts[h] .. starts[h] + lens[h], and rows up to the next head's start are slack
        self.buffers: dict[str, torch.Tensor] = {}
        self.starts: list[int] = []
        self.caps: list[int] = []
        self.lens: list[int] = []
        # rows written per head into these buffers by any layer sharing them (clones): an append writes in
        # place only where nobody wrote past this layer's own length, otherwise it copies (copy on write)
        self.claimed: list[int] = []
        # layers holding these buffers (this one and its clones, one shared cell): rows are rewritten in place
        # only while it is 1. A clone that is dropped unwritten is never subtracted: its original then copies
        # once, at its next eviction, which is safe
        self.row_sharers = [1]
        self.derived: dict[str, Any] = {}  # method-owned derived state (page summaries, ...)
        self.seen = 0
        self.queries: torch.Tensor | None = None  # [H_q, w, D]: the last queries attended with
        self.query_positions: torch.Tensor | None = None  # [w] their logical positions
        self.scaling: float | None = None  # set by the attention function; eviction scores need it
        self.budget: int | None = None  # tokens per head this layer was last evicted to
        self.evictions = 0  # eviction events that removed tokens
        self.peak_len = 0  # most tokens any head held at any moment
        self.relayouts = 0  # appends that found no room and copied the layer
        self.fresh = False  # updated by the forward in flight and not yet attended
        self.static: StaticRows | None = None  # set while a decode loop runs on the static layout (`make_static`)

    # -- transformers' layer protocol -------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.num_heads, self.head_dim = key_states.shape[1], key_states.shape[-1]
        self.model_kv_heads = self.num_heads
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if key_states.shape[0] != 1:
            raise ValueError("KVBenchCache supports batch size 1 (as the Ada-KV and RocketKV reference code)")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[1] != self.num_heads:  # heads split per query head: every copy gets the token
            copies = self.num_heads // key_states.shape[1]
            key_states = key_states.repeat_interleave(copies, dim=1)
            value_states = value_states.repeat_interleave(copies, dim=1)
        if self.static is not None:
            return self._static_update(key_states, value_states)
        q = key_states.shape[2]
        before = self.kv_nbytes()
        new_pos = torch.arange(self.seen, self.seen + q, dtype=torch.int32, device=key_states.device)
        incoming = {"keys": key_states[0], "values": value_states[0], "positions": new_pos.expand(self.num_heads, q)}
        if not self.buffers:
            self._install({name: t.reshape(-1, *t.shape[2:]) for name, t in incoming.items()}, [q] * self.num_heads)
        else:
            self._append(incoming, q)
        self.seen += q
        self.derived = {name: state.append(self, q) for name, state in self.derived.items()}
        self.peak_len = max(self.peak_len, self.physical_length())
        self.cache._account(self.kv_nbytes() - before)
        self.fresh = True  # the attention function checks that the forward it serves updated this layer
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.physical_length(), 0

    def get_max_length(self) -> int:
        return -1

    # -- storage -----------------------------------------------------------------------------------------
    @property
    def is_ragged(self) -> bool:
        return len(set(self.lens)) > 1


    def field(self, name: str) -> torch.Tensor:
        """A per-token field: a `[H, L, ...]` view on a uniform layer (`[1, H, L, D]` for keys and values,
        as the model sees them), the flat buffer `[R, ...]` (slack included; see `starts`) of keys, values
        and positions on a ragged one, and a compact copy of method state there."""
        buf = self.buffers[name]
        if self.static is not None:  # the whole capacity: [H, width] views, or the flat buffers
            if not self.static.uniform:
                return buf
            view = buf.view(self.num_heads, self.static.width, *buf.shape[1:])
            return view[None] if name in ("keys", "values") else view
        if not self.is_ragged:
            heads = len(self.lens)
            view = buf.view(heads, buf.shape[0] // heads, *buf.shape[1:])[:, : self.lens[0]]
            return view[None] if name in ("keys", "values") else view
        return buf if name in FIXED_FIELDS else buf.index_select(0, self.used_rows())

    def set_field(self, name: str, value: torch.Tensor) -> None:
        """Install a per-token field given in `field`'s compact shape, as a new buffer in the row layout."""
        template = self.buffers["positions"]
        buf = value.new_zeros(template.shape[0], *value.shape[1 + (not self.is_ragged):])
        buf.index_copy_(0, self.used_rows(), value.reshape(-1, *buf.shape[1:]))
        self.buffers[name] = buf

    keys = property(lambda self: self.field("keys") if self.buffers else None)
    values = property(lambda self: self.field("values") if self.buffers else None)
    positions = property(lambda self: self.field("positions") if self.buffers else None)

    @property
    def token_state(self) -> TokenState:
        return TokenState(self)

    def drop_token_state(self) -> None:
        for name in list(self.token_state):
            del self.buffers[name]

    def used_rows(self) -> torch.Tensor:
        """The buffer rows holding tokens, head after head."""
        device = self.buffers["positions"].device
        return torch.cat([torch.arange(s, s + n, device=device) for s, n in zip(self.starts, self.lens)])

    def lengths(self) -> list[int]:
        if self.static is not None:
            raise RuntimeError("a static layer's lengths are on the device (`head_view().lengths`) until make_dynamic")
        return list(self.lens)

    def held_tokens(self) -> "int | torch.Tensor":
        """Tokens held over all heads: an int, or a 0-d device tensor on a static layer."""
        return self.static.fill.sum() if self.static is not None else sum(self.lens)

    def physical_length(self) -> int:
        """The longest head's tokens: the width of a padded view (on a static layer its fixed capacity)."""
        if self.static is not None:
            return self.static.width
        return max(self.lens, default=0)

    def kv_nbytes(self) -> int:
        """Bytes of the keys and values of the tokens held."""
        if not self.buffers:
            return 0
        return 2 * sum(self.lens) * self.head_dim * self.buffers["keys"].element_size()

    def kv_capacity_nbytes(self) -> int:
        """Bytes of the key and value buffers, append slack included."""
        return sum(_nbytes(self.buffers.get(name)) for name in ("keys", "values"))

    def _offsets(self) -> torch.Tensor:
        """First buffer row of each head."""
        return torch.tensor(self.starts, device=self.buffers["keys"].device)

    def _install(self, rows: dict[str, torch.Tensor], head_lens: list[int], slack: int | list[int] = 0) -> None:
        """Install per-token rows given head after head without gaps, with `slack` free rows after each head (one
        number for every head, or one per head)."""
        heads = len(head_lens)
        slacks = list(slack) if isinstance(slack, list) else [slack] * heads
        if any(slacks):
            dest = self._rows_of([n + s for n, s in zip(head_lens, slacks)], head_lens, rows["positions"].device)
            total = sum(head_lens) + sum(slacks)
            spread = {}
            for name, t in rows.items():
                buf = t.new_full((total, *t.shape[1:]), -1) if name == "positions" else t.new_zeros(total, *t.shape[1:])
                spread[name] = buf.index_copy_(0, dest, t)
            rows = spread
        self.buffers = rows
        self.row_sharers[0] -= 1
        self.row_sharers = [1]
        self.caps = [n + s for n, s in zip(head_lens, slacks)]
        self.starts = list(itertools.accumulate([0, *self.caps[:-1]]))
        self.lens = list(head_lens)
        self.claimed = list(head_lens)
        self.num_heads = heads

    @staticmethod
    def _rows_of(caps: list[int], lens: list[int], device: torch.device) -> torch.Tensor:
        starts = itertools.accumulate([0, *caps[:-1]])
        return torch.cat([torch.arange(s, s + n, device=device) for s, n in zip(starts, lens)])

    def _compact(self) -> dict[str, torch.Tensor]:
        rows = self.used_rows()
        return {name: t.index_select(0, rows) for name, t in self.buffers.items()}

    def reserve(self, tokens: int) -> None:
        """Make room for `tokens` more tokens per head, so that appending them copies nothing (derived state
        that grows with the tokens reserves its own room too)."""
        if self.buffers and not self._room_for(tokens):
            self._install(self._compact(), self.lens, slack=tokens)
            self.relayouts += 1
        for state in self.derived.values():
            if hasattr(state, "reserve"):
                state.reserve(tokens)

    def _room_for(self, q: int) -> bool:
        return all(c == n and n + q <= cap for c, n, cap in zip(self.claimed, self.lens, self.caps))

    def _append(self, incoming: dict[str, torch.Tensor], q: int) -> None:
        """Write `q` new tokens per head (`incoming[name]`: `[H, q, ...]`) after each head's rows: in place
        when the buffers have room this layer may claim, else into new buffers with slack."""
        if not self._room_for(q):
            longest = max(self.lens) + q
            self._install(self._compact(), self.lens, slack=max(q, growth_slack(longest)))
            self.relayouts += 1
        heads = len(self.lens)
        if not self.is_ragged:  # a strided slice: same rows as the index list below, one copy kernel
            length = self.lens[0]
            for name, buf in self.buffers.items():
                view = buf.view(heads, buf.shape[0] // heads, *buf.shape[1:])[:, length:length + q]
                view.copy_(incoming[name]) if name in incoming else view.zero_()
        else:
            dest = torch.tensor([s + n + i for s, n in zip(self.starts, self.lens) for i in range(q)],
                                device=self.buffers["keys"].device)
            for name, buf in self.buffers.items():
                if name in incoming:
                    buf.index_copy_(0, dest, incoming[name].reshape(-1, *buf.shape[1:]))
                else:
                    buf.index_fill_(0, dest, 0)
        self.lens = [n + q for n in self.lens]
        self.claimed[:] = self.lens  # in place: every layer sharing these buffers sees the claim

    def head_view(self) -> HeadView:
        """Keys/values as `[H, L_max, D]`: a free view when uniform, a padded copy when ragged. On a static layer
        `[H, width, D]` over the capacity, with `valid` and the device `lengths`."""
        if self.static is not None:
            return self._static_view()
        if not self.is_ragged:
            return HeadView(self.keys[0], self.values[0], self.positions, None)
        rows, valid = self._padded_rows()
        positions = self.buffers["positions"][rows]
        positions = torch.where(valid, positions, torch.full_like(positions, -1))
        return HeadView(self.buffers["keys"][rows], self.buffers["values"][rows], positions, valid)

    def _padded_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        lens = torch.tensor(self.lens, device=self.buffers["keys"].device)
        slot = torch.arange(int(lens.max()), device=lens.device)[None, :]
        valid = slot < lens[:, None]
        rows = (self._offsets()[:, None] + slot).clamp(max=self.buffers["keys"].shape[0] - 1)
        return rows, valid

    def token_tensor(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The method's per-token tensor `name`, created as zeros for the tokens already stored."""
        if name not in self.buffers:
            positions = self.buffers["positions"]
            self.buffers[name] = torch.zeros(positions.shape[0], dtype=dtype, device=positions.device)
        return self.token_state[name]

    def retain(self, indices: list[torch.Tensor]) -> None:
        """Keep, per head, the tokens at `indices[h]` (sorted positions in the head's current storage).

        `G * H` index lists split every head into G copies, copy `i` reading head `i // G` (per-query-head
        eviction). Keys, values, positions and every token-state tensor move with the same rows. An eviction
        that drops few rows per head from buffers this layer holds alone (`_rewritable`: a decode step's) moves
        the kept rows down in place, and the rows it frees are slack for the next appends; any other (a
        compression) gathers the kept rows into new compact tensors, so the old storage is freed.
        """
        if len(indices) % self.num_heads:
            raise ValueError(f"{len(indices)} index lists for {self.num_heads} heads")
        copies = len(indices) // self.num_heads
        new_lens = [int(ix.numel()) for ix in indices]
        before = self.kv_nbytes()
        if copies == 1 and self._rewritable(new_lens):
            self._retain_in_place(indices, new_lens)
        else:
            device = self.buffers["keys"].device
            rows = torch.cat([ix.to(device) + self.starts[i // copies] for i, ix in enumerate(indices)])
            self._install({name: t.index_select(0, rows) for name, t in self.buffers.items()}, new_lens)
        # derived from rows that changed: dropped (the method rebuilds it) unless the state says it still holds
        self.derived = {name: kept for name, state in self.derived.items()
                    if (kept := getattr(state, "kept", lambda layer: None)(self)) is not None}
        self.evictions += 1
        self.cache._account(self.kv_nbytes() - before)

    def _rewritable(self, kept: list[int]) -> bool:
        """Whether an eviction to `kept` tokens per head may rewrite the rows in place: no other layer holds
        these buffers, no head drops more rows than an append's slack (a compression copies instead, which
        frees its memory rather than leaving it as slack), and equal lengths keep equal capacities (what a
        uniform layer's `[H, cap, ...]` views need)."""
        few = growth_slack(max(kept))
        return (self.row_sharers[0] == 1 and all(n - k <= few for n, k in zip(self.lens, kept))
                and (len(set(kept)) > 1 or len(set(self.caps)) == 1))

    @torch.inference_mode()  # buffers written in a forward are inference tensors; a rollback rewrites them after it
    def _retain_in_place(self, indices: list[torch.Tensor], kept: list[int]) -> None:
        """`retain` within the buffers: each head that drops tokens gets its kept rows moved to the front of
        its rows (in order), and the freed rows are cleared as `_install` clears slack. A head that keeps
        everything (sorted, distinct indices: `kept == lens`) is not touched."""
        device = self.buffers["keys"].device
        moved = [h for h, (k, n) in enumerate(zip(kept, self.lens)) if k != n]
        if moved:
            source = torch.cat([indices[h].to(device) + self.starts[h] for h in moved])
            dest = torch.cat([torch.arange(self.starts[h], self.starts[h] + kept[h], device=device) for h in moved])
            freed = torch.cat([torch.arange(self.starts[h] + kept[h], self.starts[h] + self.lens[h], device=device)
                               for h in moved])
            for name, buf in self.buffers.items():
                buf.index_copy_(0, dest, buf.index_select(0, source))
                buf.index_fill_(0, freed, -1 if name == "positions" else 0)
        self.lens, self.claimed = list(kept), list(kept)

    # -- the static decode layout (kvbench.cache.static) ---------------------------------------------------
    def make_static(self, tokens: int, query_window: int, query_heads: int, ragged: bool = False) -> None:
        """Enter the static layout for a decode loop of up to `tokens` appends: one copy into buffers of a fixed,
        bucketed capacity that this layer holds alone, lengths on the device, the last `query_window` queries in
        a buffer of that size (empty entries at position -1), derived state at the same capacity. `ragged`: the
        flat layout even if every head holds as many tokens (a method whose layers may be ragged)."""
        heads, device = len(self.lens), self.buffers["keys"].device
        uniform = not (ragged or self.is_ragged)
        if uniform:
            width = bucketed(self.lens[0] + tokens)
            slack: list[int] = [width - self.lens[0]] * heads
        else:  # fixed total rows, each head its own room: nothing padded to the longest head
            slack = [tokens] * heads
            slack[-1] += bucketed(sum(self.lens) + heads * tokens) - (sum(self.lens) + heads * tokens)
            width = bucketed(max(self.lens) + tokens)
        self._install(self._compact(), list(self.lens), slack=slack)
        starts = torch.tensor(self.starts, dtype=torch.int64, device=device)
        fill = torch.tensor(self.lens, dtype=torch.int64, device=device)
        row_head = row_slot = None
        if not uniform:
            caps = torch.tensor(self.caps, dtype=torch.int64, device=device)
            row_head = torch.repeat_interleave(torch.arange(heads, device=device), caps)
            row_slot = torch.arange(row_head.shape[0], device=device) - starts[row_head]
        self.static = StaticRows(
            starts=starts, fill=fill, next_slot=fill.clone(),
            peak=torch.tensor(self.peak_len, dtype=torch.int64, device=device),
            evictions=torch.zeros((), dtype=torch.int64, device=device), width=width, uniform=uniform,
            row_bytes=2 * self.head_dim * self.buffers["keys"].element_size(), row_head=row_head, row_slot=row_slot)
        for name, state in list(self.derived.items()):
            if not hasattr(state, "make_static"):
                raise NotImplementedError(f"{type(state).__name__} (derived state {name!r}) has no static layout")
            self.derived[name] = state.make_static(self)
        if query_window:
            self._static_queries(query_window, query_heads, device)

    def _static_queries(self, window: int, heads: int, device: torch.device) -> None:
        """The last `window` queries in a buffer of exactly `window` entries, oldest first (empty: position -1)."""
        kept = 0 if self.queries is None else min(window, self.queries.shape[1])
        queries = torch.zeros(heads, window, self.head_dim, dtype=self.dtype, device=device)
        positions = torch.full((window,), -1, dtype=torch.int32, device=device)
        if kept:
            queries[:, window - kept:] = self.queries[:, -kept:]
            positions[window - kept:] = self.query_positions[-kept:]
        self.queries, self.query_positions = queries, positions

    def _static_update(self, key_states: torch.Tensor, value_states: torch.Tensor):
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

    def _static_view(self) -> HeadView:
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

    def static_remember_query(self, query: torch.Tensor) -> None:
        """The step's queries `[H_q, 1, D]` become the newest entry of the static query window (oldest drops)."""
        self.queries.copy_(torch.cat([self.queries[:, 1:], query], dim=1))
        position = self.cache.static_position.to(self.query_positions.dtype)
        self.query_positions.copy_(torch.cat([self.query_positions[1:], position]))

    def static_host_numbers(self) -> list[torch.Tensor]:
        """What `make_dynamic` reads back, as 1-d int64 tensors: fill, next_slot, [peak, evictions]."""
        st = self.static
        return [st.fill, st.next_slot, torch.stack([st.peak, st.evictions])]

    def make_dynamic(self, fill: list[int], next_slot: list[int], peak: int, evictions: int) -> None:
        """Leave the static layout after its decode loop (the device numbers read back once, by the cache). A
        layer that evicted while decoding is compacted into position order, as the eager layout keeps it."""
        st, self.static = self.static, None
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
        if self.query_positions is not None and bool((self.query_positions < 0).any()):
            kept_queries = self.query_positions >= 0
            self.queries = self.queries[:, kept_queries].clone() if bool(kept_queries.any()) else None
            self.query_positions = self.query_positions[kept_queries].clone() if self.queries is not None else None

    def truncate(self, logical_length: int) -> None:
        """Drop every stored token (and query) whose logical position is >= `logical_length` (rollback)."""
        view = self.head_view()
        keep = [torch.nonzero((p >= 0) & (p < logical_length)).flatten() for p in view.positions]
        if any(int(ix.numel()) != n for ix, n in zip(keep, self.lengths())):
            evictions, aux = self.evictions, self.derived
            self.retain(keep)
            self.evictions, self.derived = evictions, aux  # a rollback is not an eviction: the state truncates
        self.seen = logical_length  # before the derived state truncates: it reads what is left
        self.derived = {name: cut for name, state in self.derived.items() if (cut := state.truncate(self)) is not None}
        if self.queries is not None:
            old = self.query_positions < logical_length
            self.queries, self.query_positions = self.queries[:, old].clone(), self.query_positions[old].clone()

    def remember_queries(self, queries: torch.Tensor, window: int) -> None:
        """Keep the last `window` queries `[H_q, q, D]` of the chunk just attended (new tensors, no views)."""
        if self.static is not None:
            self.static_remember_query(queries)
            return
        q = queries.shape[1]
        positions = torch.arange(self.seen - q, self.seen, dtype=torch.int32, device=queries.device)
        if self.queries is not None and q < window:
            queries = torch.cat([self.queries, queries], dim=1)
            positions = torch.cat([self.query_positions, positions])
        self.queries, self.query_positions = queries[:, -window:].clone(), positions[-window:].clone()

    def method_state_nbytes(self) -> int:
        held = sum(self.lens)
        per_token = sum(t[0].numel() * t.element_size() * held for t in self.token_state_buffers())
        queries = _nbytes(self.queries) + _nbytes(self.query_positions)
        return per_token + queries + sum(state.nbytes() for state in self.derived.values())

    def token_state_buffers(self) -> list[torch.Tensor]:
        return [t for name, t in self.buffers.items() if name not in FIXED_FIELDS]

    def tensors(self) -> list[torch.Tensor]:
        queries = [t for t in (self.queries, self.query_positions) if t is not None]
        return [*self.buffers.values(), *queries]

    def clone_into(self, cache: Cache) -> "KVLayer":
        """A layer for `cache` that shares this layer's buffers: shared rows are never rewritten, and an append
        writes in place only into slack nobody else claimed (see `claimed`)."""
        if self.static is not None:
            raise RuntimeError("a layer in the static decode layout is not cloned (make_dynamic first)")
        copy = KVLayer(self.layer_idx, cache)
        copy.__dict__.update({k: v for k, v in self.__dict__.items() if k != "cache"})
        copy.cache = cache
        copy.buffers = dict(self.buffers)
        self.row_sharers[0] += 1  # the copy holds the same cell (`__dict__` above)
        copy.starts, copy.caps, copy.lens = list(self.starts), list(self.caps), list(self.lens)
        # immutable derived state is shared; state that updates in place (page summaries, CTKVR's index) is forked
        copy.derived = {name: state.fork() if hasattr(state, "fork") else state for name, state in self.derived.items()}
        return copy
