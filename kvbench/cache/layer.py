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
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvbench.cache.static import StaticLayout, StaticRows
from kvbench.cache.token_state import FIXED_FIELDS, TokenState
from kvbench.core.contract import HeadView


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


GROWTH = 0.25  # slack added when an append finds no room: a quarter of the longest head (amortised O(1))


MIN_SLACK = 16


def growth_slack(longest: int) -> int:
    """Free rows per head a layer whose longest head holds `longest` tokens gets when it grows."""
    return max(MIN_SLACK, math.ceil(GROWTH * longest))


class KVLayer(StaticLayout, CacheLayerMixin):
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
        self.query_slot: torch.Tensor | None = None  # the static layout's window is a ring: its oldest entry
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
