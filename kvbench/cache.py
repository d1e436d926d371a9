"""The KV cache: per-layer storage in which every KV head may hold a different set of tokens.

Storage (batch size 1, as in the Ada-KV and RocketKV reference code): every per-token field of a layer
(keys, values, positions, a method's token state) is one flat row buffer `[R, ...]`; head h's tokens are
rows `starts[h] .. starts[h] + len_h`, and the rows up to the next head's start are slack for appends.

- *uniform*: every head holds the same number of tokens and the heads are evenly strided, so `keys`/
  `values` are `[1, H, L, D]` views and `positions` is `[H, L]`. Full cache and uniform eviction
  (StreamingLLM, SnapKV, KeyDiff, ...) live here, and the uncompressed attention path is exactly the stock
  SDPA call (on a strided view: bitwise the same as on a contiguous copy).
- *ragged*: heads hold different numbers of tokens (Ada-KV). `keys`/`values` are the flat buffers with
  `starts` and `head_lens` (the official Ada-KV layout, `cu_seqlens` style), so evicted tokens are really
  freed rather than padded.

Appending a token writes one row per head into the slack: amortised O(1), never a copy of the layer. When
a head has no room, the layer is copied once into buffers with slack (a quarter of the longest head, or
what `reserve` asked for: the engine reserves the tokens it is about to decode). Eviction and rollback
gather the kept rows with `index_select` into new compact buffers, so the old storage is freed (a slice
would keep it alive). `kv_bytes` counts the tokens held, `kv_capacity_bytes` the buffers with their slack.

`H` is the model's KV heads, unless a method split every KV head into one copy per query head (SnapKV per
query head, RocketKV's baseline): `keep` with G index lists per KV head does that, new tokens are then
appended to every copy, and the attention paths see a GQA group of 1. The storage that costs is counted.

Per-token state travels with the tokens. `positions` (each stored token's logical position; RoPE is
already applied to the keys) and a method's `token_state` tensors (H2O's accumulated attention) share one
row layout, so eviction, appends and rollback move all of them with one set of row indices and no method
keeps a side table that could drift from the cache. A layer also keeps the last `cache.query_window`
queries it attended with (`queries`, `query_positions`): the observation window of SnapKV-like scores,
whether eviction runs at the end of a segment, after a prefill block or during decoding.

Derived state a selection method reads (page summaries, SparQ's transposed keys) is `aux`: immutable objects
the method builds (`Method.build_aux`) when the segment ends; the cache hands every append and rollback to
them (`append(layer, n)` / `truncate(layer)` return the updated object) and drops them when an eviction
changes the rows, after which the method rebuilds them.

`seen` counts logical tokens and `get_seq_length()` reports it, so transformers' default positions stay
right after eviction (the engine passes explicit `position_ids` anyway).

A prefill snapshot and a teacher-forcing twin share buffers with the cache they were cloned from. That is
safe because no stored row is ever rewritten, and an append writes into slack only where no layer sharing
the buffers has written past its own length (`claimed`); otherwise it copies (copy on write).
"""

from __future__ import annotations

import itertools
import math
import threading
import weakref
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

if TYPE_CHECKING:
    from kvbench.methods.base import Method, Plan

_active = threading.local()


def active_layers(key: torch.Tensor) -> "list[KVLayer] | None":
    """The layers whose `update` returned `key`, one per batch row: the layers the model is attending with
    right now (one layer for a `KVBenchCache`, one per row's cache for a `BatchedCache`).

    The identity check catches a forward that silently used a cache of its own (transformers creates a
    DynamicCache when none is passed): the pointer would otherwise refer to stale layers.
    """
    layers = getattr(_active, "layers", None)
    returned = getattr(_active, "key", None)
    if layers is None or returned is None or returned() is not key:
        return None
    return layers


def _set_active(layers: "list[KVLayer]", key: torch.Tensor) -> None:
    _active.layers, _active.key = layers, weakref.ref(key)


@dataclass
class HeadView:
    """A padded `[H, L_max, D]` view of a layer plus a validity mask (None when no padding)."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor  # [H, L_max], -1 on padding
    valid: torch.Tensor | None  # [H, L_max] bool


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


FIXED_FIELDS = ("keys", "values", "positions")
GROWTH = 0.25  # slack added when an append finds no room: a quarter of the longest head (amortised O(1))
MIN_SLACK = 16


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

    def __init__(self, layer_idx: int, cache: "KVBenchCache"):
        # not CacheLayerMixin.__init__: it assigns `keys`/`values`, which are views of `buffers` here
        self.is_initialized = False
        self.layer_idx = layer_idx
        self.cache = cache
        # flat row buffers `[R, ...]`, one per per-token field (keys, values, positions, method state); head h
        # holds rows starts[h] .. starts[h] + head_lens[h], and rows up to the next head's start are slack
        self.buffers: dict[str, torch.Tensor] = {}
        self.starts: list[int] = []
        self.caps: list[int] = []
        self.head_lens_: list[int] = []
        # rows written per head into these buffers by any layer sharing them (clones): an append writes in
        # place only where nobody wrote past this layer's own length, otherwise it copies (copy on write)
        self.claimed: list[int] = []
        self.aux: dict[str, Any] = {}  # method-owned derived state (page summaries, ...), immutable objects
        self.seen = 0
        self.prefilled = 0  # logical length after the last multi-token chunk: what decode steps follow
        self.queries: torch.Tensor | None = None  # [H_q, w, D]: the last queries attended with
        self.query_positions: torch.Tensor | None = None  # [w] their logical positions
        self.scaling: float | None = None  # set by the attention function; eviction scores need it
        self.budget: int | None = None  # tokens per head this layer was last evicted to
        self.evictions = 0  # eviction events that removed tokens
        self.peak_len = 0  # most tokens any head held at any moment
        self.relayouts = 0  # appends that found no room and copied the layer

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
        q = key_states.shape[2]
        before = self.kv_nbytes()
        new_pos = torch.arange(self.seen, self.seen + q, dtype=torch.int32, device=key_states.device)
        incoming = {"keys": key_states[0], "values": value_states[0], "positions": new_pos.expand(self.num_heads, q)}
        if not self.buffers:
            self._install({name: t.reshape(-1, *t.shape[2:]) for name, t in incoming.items()}, [q] * self.num_heads)
        else:
            self._append(incoming, q)
        self.seen += q
        if q > 1:
            self.prefilled = self.seen
        self.aux = {name: state.append(self, q) for name, state in self.aux.items()}
        self.peak_len = max(self.peak_len, self.physical_length())
        self.cache._account(self.kv_nbytes() - before)
        keys = self.keys
        _set_active([self], keys)
        return keys, self.values

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.physical_length(), 0

    def get_max_length(self) -> int:
        return -1

    # -- storage -----------------------------------------------------------------------------------------
    @property
    def is_ragged(self) -> bool:
        return len(set(self.head_lens_)) > 1

    @property
    def head_lens(self) -> list[int] | None:
        """Tokens per head on a ragged layer; None on a uniform one."""
        return list(self.head_lens_) if self.is_ragged else None

    def field(self, name: str) -> torch.Tensor:
        """A per-token field: a `[H, L, ...]` view on a uniform layer (`[1, H, L, D]` for keys and values,
        as the model sees them), the flat buffer `[R, ...]` (slack included; see `starts`) of keys, values
        and positions on a ragged one, and a compact copy of method state there."""
        buf = self.buffers[name]
        if not self.is_ragged:
            heads = len(self.head_lens_)
            view = buf.view(heads, buf.shape[0] // heads, *buf.shape[1:])[:, : self.head_lens_[0]]
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
        return torch.cat([torch.arange(s, s + n, device=device) for s, n in zip(self.starts, self.head_lens_)])

    def lengths(self) -> list[int]:
        return list(self.head_lens_)

    def physical_length(self) -> int:
        return max(self.head_lens_, default=0)

    def kv_nbytes(self) -> int:
        """Bytes of the keys and values of the tokens held."""
        if not self.buffers:
            return 0
        return 2 * sum(self.head_lens_) * self.head_dim * self.buffers["keys"].element_size()

    def kv_capacity_nbytes(self) -> int:
        """Bytes of the key and value buffers, append slack included."""
        return sum(_nbytes(self.buffers.get(name)) for name in ("keys", "values"))

    def _offsets(self) -> torch.Tensor:
        """First buffer row of each head."""
        return torch.tensor(self.starts, device=self.buffers["keys"].device)

    def _install(self, rows: dict[str, torch.Tensor], head_lens: list[int], slack: int = 0) -> None:
        """Install per-token rows given head after head without gaps, with `slack` free rows after each head."""
        heads = len(head_lens)
        if slack:
            dest = self._rows_of([n + slack for n in head_lens], head_lens, rows["positions"].device)
            total = sum(head_lens) + heads * slack
            spread = {}
            for name, t in rows.items():
                buf = t.new_full((total, *t.shape[1:]), -1) if name == "positions" else t.new_zeros(total, *t.shape[1:])
                spread[name] = buf.index_copy_(0, dest, t)
            rows = spread
        self.buffers = rows
        self.caps = [n + slack for n in head_lens]
        self.starts = list(itertools.accumulate([0, *self.caps[:-1]]))
        self.head_lens_ = list(head_lens)
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
        """Make room for `tokens` more tokens per head, so that appending them copies nothing."""
        if self.buffers and not self._room_for(tokens):
            self._install(self._compact(), self.head_lens_, slack=tokens)
            self.relayouts += 1

    def _room_for(self, q: int) -> bool:
        return all(c == n and n + q <= cap for c, n, cap in zip(self.claimed, self.head_lens_, self.caps))

    def _append(self, incoming: dict[str, torch.Tensor], q: int) -> None:
        """Write `q` new tokens per head (`incoming[name]`: `[H, q, ...]`) after each head's rows: in place
        when the buffers have room this layer may claim, else into new buffers with slack."""
        if not self._room_for(q):
            longest = max(self.head_lens_) + q
            self._install(self._compact(), self.head_lens_, slack=max(q, MIN_SLACK, math.ceil(GROWTH * longest)))
            self.relayouts += 1
        heads = len(self.head_lens_)
        if not self.is_ragged:  # a strided slice: same rows as the index list below, one copy kernel
            length = self.head_lens_[0]
            for name, buf in self.buffers.items():
                view = buf.view(heads, buf.shape[0] // heads, *buf.shape[1:])[:, length:length + q]
                view.copy_(incoming[name]) if name in incoming else view.zero_()
        else:
            dest = torch.tensor([s + n + i for s, n in zip(self.starts, self.head_lens_) for i in range(q)],
                                device=self.buffers["keys"].device)
            for name, buf in self.buffers.items():
                if name in incoming:
                    buf.index_copy_(0, dest, incoming[name].reshape(-1, *buf.shape[1:]))
                else:
                    buf.index_fill_(0, dest, 0)
        self.head_lens_ = [n + q for n in self.head_lens_]
        self.claimed[:] = self.head_lens_  # in place: every layer sharing these buffers sees the claim

    def head_view(self) -> HeadView:
        """Keys/values as `[H, L_max, D]`: a free view when uniform, a padded copy when ragged."""
        if not self.is_ragged:
            return HeadView(self.keys[0], self.values[0], self.positions, None)
        rows, valid = self._padded_rows()
        positions = self.buffers["positions"][rows]
        positions = torch.where(valid, positions, torch.full_like(positions, -1))
        return HeadView(self.buffers["keys"][rows], self.buffers["values"][rows], positions, valid)

    def _padded_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        lens = torch.tensor(self.head_lens_, device=self.buffers["keys"].device)
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

    def keep(self, indices: list[torch.Tensor]) -> None:
        """Keep, per head, the tokens at `indices[h]` (sorted positions in the head's current storage).

        `G * H` index lists split every head into G copies, copy `i` reading head `i // G` (per-query-head
        eviction). Keys, values, positions and every token-state tensor are gathered with the same rows into
        new compact tensors, so the old storage is freed.
        """
        if len(indices) % self.num_heads:
            raise ValueError(f"{len(indices)} index lists for {self.num_heads} heads")
        copies = len(indices) // self.num_heads
        device = self.buffers["keys"].device
        rows = torch.cat([ix.to(device) + self.starts[i // copies] for i, ix in enumerate(indices)])
        before = self.kv_nbytes()
        self._install({name: t.index_select(0, rows) for name, t in self.buffers.items()},
                      [int(ix.numel()) for ix in indices])
        # derived from rows that changed: dropped (the method rebuilds it) unless the state says it still holds
        self.aux = {name: kept for name, state in self.aux.items()
                    if (kept := getattr(state, "kept", lambda layer: None)(self)) is not None}
        self.evictions += 1
        self.cache._account(self.kv_nbytes() - before)

    def truncate(self, logical_length: int) -> None:
        """Drop every stored token (and query) whose logical position is >= `logical_length` (rollback)."""
        view = self.head_view()
        keep = [torch.nonzero((p >= 0) & (p < logical_length)).flatten() for p in view.positions]
        if any(int(ix.numel()) != n for ix, n in zip(keep, self.lengths())):
            evictions, aux = self.evictions, self.aux
            self.keep(keep)
            self.evictions, self.aux = evictions, aux  # a rollback is not an eviction: the state truncates
        self.seen = logical_length  # before the derived state truncates: it reads what is left
        self.aux = {name: cut for name, state in self.aux.items() if (cut := state.truncate(self)) is not None}
        self.prefilled = min(self.prefilled, logical_length)
        if self.queries is not None:
            old = self.query_positions < logical_length
            self.queries, self.query_positions = self.queries[:, old].clone(), self.query_positions[old].clone()

    def remember_queries(self, queries: torch.Tensor, window: int) -> None:
        """Keep the last `window` queries `[H_q, q, D]` of the chunk just attended (new tensors, no views)."""
        q = queries.shape[1]
        positions = torch.arange(self.seen - q, self.seen, dtype=torch.int32, device=queries.device)
        if self.queries is not None and q < window:
            queries = torch.cat([self.queries, queries], dim=1)
            positions = torch.cat([self.query_positions, positions])
        self.queries, self.query_positions = queries[:, -window:].clone(), positions[-window:].clone()

    def method_state_nbytes(self) -> int:
        held = sum(self.head_lens_)
        per_token = sum(t[0].numel() * t.element_size() * held for t in self.token_state_buffers())
        queries = _nbytes(self.queries) + _nbytes(self.query_positions)
        return per_token + queries + sum(state.nbytes() for state in self.aux.values())

    def token_state_buffers(self) -> list[torch.Tensor]:
        return [t for name, t in self.buffers.items() if name not in FIXED_FIELDS]

    def tensors(self) -> list[torch.Tensor]:
        queries = [t for t in (self.queries, self.query_positions) if t is not None]
        return [*self.buffers.values(), *queries]

    def clone_into(self, cache: "KVBenchCache") -> "KVLayer":
        """A layer for `cache` that shares this layer's buffers: rows are never rewritten, and an append
        writes in place only into slack nobody else claimed (see `claimed`)."""
        twin = KVLayer(self.layer_idx, cache)
        twin.__dict__.update({k: v for k, v in self.__dict__.items() if k != "cache"})
        twin.cache = cache
        twin.buffers = dict(self.buffers)
        twin.starts, twin.caps, twin.head_lens_ = list(self.starts), list(self.caps), list(self.head_lens_)
        # immutable derived state is shared; state that updates in place (CTKVR's index) is forked
        twin.aux = {name: state.fork() if hasattr(state, "fork") else state for name, state in self.aux.items()}
        return twin


class KVBenchCache(Cache):
    """A transformers Cache whose layers implement kvbench's storage and run the method's hooks.

    The engine owns the loop and decides when an eviction event happens: it sets `evict_now` around the
    forward pass that ends one (the compressed segment, a prefill block, every N-th decode step). The
    attention function then, on each layer right after that layer's attention, records the queries the
    method's scores need (`query_window`), lets the method observe the attention (`observing`, H2O) and, when
    `evict_now`, runs `KVLayer.evict`: at peak only one layer holds its uncompressed KV plus the chunk, as in
    the reference implementations. A dense snapshot instead keeps `query_window` queries per layer and
    evicts later through `compress`, which lets one dense prefill serve many methods and budgets.
    """

    def __init__(self, num_layers: int, method: "Method | None" = None, plan: "Plan | None" = None):
        super().__init__(layers=[KVLayer(i, self) for i in range(num_layers)])
        self.method = method
        self.plan = plan  # the method's budgets for this sample (None: no method, nothing is evicted)
        self.evict_now = False
        self.query_window = 0
        self.observing = False
        self.shared: dict[str, Any] = {}  # method-owned state shared by the layers of one step (OmniKV)
        self.measure_recall = False  # selection methods: top-k attention-mass recall of every decode step
        self.stats = DecodeStats()
        self._kv_bytes = 0
        self.kv_peak_bytes = 0  # the most K/V bytes held at any moment
        self.track_method_state(method is not None and method.schedule() is not None)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def _account(self, delta: int) -> None:
        self._kv_bytes += delta
        self.kv_peak_bytes = max(self.kv_peak_bytes, self._kv_bytes)

    def track_method_state(self, live: bool) -> None:
        """Keep (and feed) the method's state only while an eviction event can still happen; free it after."""
        method = self.method if live else None
        self.observing = method is not None and method.observes
        self.query_window = method.obs_window if method is not None else 0
        for layer in self.layers:
            if not live:
                layer.drop_token_state()
            if layer.queries is not None and layer.queries.shape[1] > self.query_window:
                keep = layer.queries.shape[1] - self.query_window
                layer.queries = layer.queries[:, keep:].clone() if self.query_window else None
                layer.query_positions = layer.query_positions[keep:].clone() if self.query_window else None

    @property
    def budget(self) -> int | None:
        """Tokens per KV head the eviction hook keeps (None: nothing is evicted)."""
        return self.plan.evict if self.plan is not None else None

    def end_segment(self) -> None:
        """The compressed segment is done: the method's state lives on only if later events still evict, and
        its derived state is built over what the layers now hold."""
        schedule = self.method.schedule() if self.method is not None else None
        self.track_method_state(bool(schedule and (schedule.decode_every or schedule.every_turn)))
        if self.method is not None:
            for layer in self.layers:
                if not layer.aux and layer.keys is not None:
                    layer.aux = self.method.build_aux(layer)

    def nbytes(self) -> int:
        """Bytes of the distinct storages this cache holds: what eviction really freed, not a mask count."""
        seen: dict[int, int] = {}
        for layer in self.layers:
            for t in layer.tensors():
                storage = t.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
        return sum(seen.values())

    def kv_bytes(self) -> int:
        """Bytes of the keys and values of the tokens held (without positions or method state)."""
        return sum(layer.kv_nbytes() for layer in self.layers)

    def kv_capacity_bytes(self) -> int:
        """Bytes of the key and value buffers, the slack reserved for appends included."""
        return sum(layer.kv_capacity_nbytes() for layer in self.layers)

    def reserve(self, tokens: int) -> None:
        """Room for `tokens` more tokens in every layer, so that decoding them copies no layer."""
        for layer in self.layers:
            layer.reserve(tokens)

    def method_state_bytes(self) -> int:
        """Bytes of the method's own state: per-token tensors and the kept observation queries."""
        return sum(layer.method_state_nbytes() for layer in self.layers)

    def kept_per_head(self) -> list[list[int]]:
        return [layer.lengths() for layer in self.layers]

    def peak_entries_per_head(self) -> int:
        """The most tokens any head of any layer held at any moment (prefill blocks and decode included)."""
        return max((layer.peak_len for layer in self.layers), default=0)

    def evictions(self) -> int:
        """Eviction events that removed tokens (the most over layers)."""
        return max((layer.evictions for layer in self.layers), default=0)

    def truncate(self, logical_length: int) -> None:
        for layer in self.layers:
            layer.truncate(logical_length)
        self._kv_bytes = sum(layer.kv_nbytes() for layer in self.layers)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].seen if self.layers else 0

    def compress(self) -> None:
        """Deferred eviction at the end of a dense segment: the method's hook on every layer, from the kept
        queries, exactly as it would have run inline."""
        for layer in self.layers:
            evict_layer(layer)
        self.end_segment()

    def clone(self) -> "KVBenchCache":
        """A copy that shares the (never mutated in place) tensors: costs no memory until it diverges. Its
        decode statistics start empty."""
        twin = KVBenchCache(0, self.method, self.plan)
        twin.layers = [layer.clone_into(twin) for layer in self.layers]
        for key in ("evict_now", "query_window", "observing", "measure_recall", "_kv_bytes", "kv_peak_bytes"):
            setattr(twin, key, getattr(self, key))
        twin.shared = dict(self.shared)
        return twin


@dataclass
class DecodeStats:
    """What the decode steps of one cache read, by the method's own cost model, and how well selections
    recalled the exact top-k attention mass (both summed over layers; divide by `layer_steps`)."""

    layer_steps: int = 0
    read_elements: int = 0  # K/V and auxiliary elements read, all heads
    moved_bytes: int = 0  # between host and device
    extra_sums: dict[str, float] = field(default_factory=dict)  # a method's own per-step numbers
    extra_steps: int = 0
    read_token_equivalents: float = 0.0  # read_elements / (2 D) per KV group: comparable to a token budget
    recall_sum: float = 0.0
    recall_steps: int = 0

    def add(self, layer: "KVLayer", elements: int, recall: float | None, moved_bytes: int = 0,
            extra: dict[str, float] | None = None) -> None:
        self.layer_steps += 1
        self.read_elements += elements
        self.moved_bytes += moved_bytes
        if extra:
            self.extra_steps += 1
            for key, value in extra.items():
                self.extra_sums[key] = self.extra_sums.get(key, 0.0) + value
        self.read_token_equivalents += elements / (2 * layer.head_dim * layer.model_kv_heads)
        if recall is not None:
            self.recall_sum += recall
            self.recall_steps += 1


def evict_layer(layer: KVLayer) -> None:
    """One eviction event on one layer: the method picks, per head, what to keep of the layer's budget."""
    cache = layer.cache
    if cache.method is None or cache.budget is None:
        return
    layer.budget = cache.method.layer_budget(layer, cache.budget)
    keep = cache.method.keep(layer, layer.budget)
    if keep is not None:
        layer.keep(keep)


class BatchedCache(Cache):
    """Several `KVBenchCache`s decoded as one batch: row b of every forward is `caches[b]`.

    Each row keeps its own storage (uniform or ragged), method, plan, hooks, statistics and accounting; the
    model's dense layers run once over all rows, so a decode step reads the weights once for all of them,
    and the attention function attends row by row, each on its own layer (`active_layers`). Rows may hold
    different lengths (positions are passed per row).
    """

    def __init__(self, caches: list[KVBenchCache]):
        if not caches or len({c.num_layers for c in caches}) != 1:
            raise ValueError("a batch needs one or more caches of the same model")
        super().__init__(layers=[_BatchedLayer([c.layers[i] for c in caches]) for i in range(caches[0].num_layers)])
        self.caches = caches

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(c.get_seq_length(layer_idx) for c in self.caches)


class _BatchedLayer(CacheLayerMixin):
    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self, rows: list[KVLayer]):
        super().__init__()
        self.rows = rows
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if key_states.shape[0] != len(self.rows):
            raise ValueError(f"a batch of {key_states.shape[0]} rows for {len(self.rows)} caches")
        for b, layer in enumerate(self.rows):
            layer.update(key_states[b:b + 1], value_states[b:b + 1])
        _set_active(self.rows, key_states)  # the attention function reads each row's own layer
        return key_states, value_states

    def get_seq_length(self) -> int:
        return max(layer.seen for layer in self.rows)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return max(layer.physical_length() for layer in self.rows), 0

    def get_max_length(self) -> int:
        return -1
