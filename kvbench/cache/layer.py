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

Two layer types share this storage, as transformers 5 has `DynamicLayer` and `StaticLayer`: `DynamicKVLayer`
(`kvbench.cache.dynamic`), the eager layout described above, and `StaticKVLayer` (`kvbench.cache.static`), the
fixed-capacity layout a decode loop runs on. A cache's layers are dynamic; `KVBenchCache.make_static` turns each
into a static one for a decode loop and `make_dynamic` turns it back, in place (the object's type is swapped, so
`cache.layers[i]` and every reference to a layer stay the same object). What differs between the layouts is a
method of the layer types (`field`, `head_view`, `dense_decode`, `attend_selected`, `account_selected_step`,
`evict`, ...), so that no code outside the cache asks which layout a layer is in; `is_static` says it where a
method's own arithmetic differs (H2O's observation of a decode step, KeyDiff's anchor over the valid slots).
"""

from __future__ import annotations

import itertools
import math
from typing import Any, ClassVar

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvbench.cache.token_state import FIXED_FIELDS, TokenState
from kvbench.core.contract import HeadView, Selection, Step, StepMethod


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


GROWTH = 0.25  # slack added when an append finds no room: a quarter of the longest head (amortised O(1))


MIN_SLACK = 16


def growth_slack(longest: int) -> int:
    """Free rows per head a layer whose longest head holds `longest` tokens gets when it grows."""
    return max(MIN_SLACK, math.ceil(GROWTH * longest))


class KVLayer(CacheLayerMixin):
    """One layer's row storage, what both layouts share: a cache's layers are `DynamicKVLayer`s, and a decode loop
    on the static layout turns them into `StaticKVLayer`s and back (module docstring). The methods below that
    raise `NotImplementedError` are the ones each layout has its own of."""

    is_compileable = False  # a True value makes generate() build 4D masks and auto-compile
    is_sliding = False
    is_croppable = False
    is_static: ClassVar[bool] = False  # the static decode layout (`StaticKVLayer`)

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
        return self._store(key_states, value_states)

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

    def token_tensor(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The method's per-token tensor `name`, created as zeros for the tokens already stored."""
        if name not in self.buffers:
            positions = self.buffers["positions"]
            self.buffers[name] = torch.zeros(positions.shape[0], dtype=dtype, device=positions.device)
        return self.token_state[name]

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

    # -- what each layout has its own of ----------------------------------------------------------------------
    def _store(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """`update`'s storing of a chunk's keys and values (`[1, H, q, D]`, one copy per head)."""
        raise NotImplementedError

    def field(self, name: str) -> torch.Tensor:
        """A per-token field: a `[H, L, ...]` view on a uniform layer (`[1, H, L, D]` for keys and values, as the
        model sees them), the flat buffer `[R, ...]` on a ragged one (see each layout's)."""
        raise NotImplementedError

    def lengths(self) -> list[int]:
        """The tokens each head holds (a dynamic layer's; a static one keeps them on the device)."""
        raise NotImplementedError

    def held_tokens(self) -> "int | torch.Tensor":
        """Tokens held over all heads: an int, or a 0-d device tensor on a static layer."""
        raise NotImplementedError

    def physical_length(self) -> int:
        """The longest head's tokens: the width of a padded view (on a static layer its fixed capacity)."""
        raise NotImplementedError

    def head_view(self) -> HeadView:
        """Keys/values as `[H, L_max, D]` with positions and a validity mask (see each layout's)."""
        raise NotImplementedError

    def remember_queries(self, queries: torch.Tensor, window: int) -> None:
        """Keep the last `window` queries `[H_q, q, D]` of the chunk just attended."""
        raise NotImplementedError

    def recent_queries(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The last `count` queries the layer attended with, oldest first, `[H_q, count, D]`, and their positions."""
        raise NotImplementedError

    def dense_decode(self, q: torch.Tensor, scaling: float, repeats_kv: bool = False) -> torch.Tensor:
        """A decode step's dense attention of the packed GQA queries `q` `[H_kv, G, D]` over every token the layer
        holds: `[H_kv, G, D]`. `repeats_kv`: the K/V copied to every query head first (RocketKV's and gpt-fast's
        Full-KV baseline, `Method.repeats_kv`)."""
        raise NotImplementedError

    def attend_selected(self, q: torch.Tensor, view: HeadView, idx: torch.Tensor, scaling: float) -> torch.Tensor:
        """A decode step's attention of `q` `[H_kv, G, D]` over the rows `idx` `[H_kv, G, k]` of `view` (this
        layer's `head_view`) that a selection method chose: `[H_kv, G, D]`."""
        raise NotImplementedError

    def account_selected_step(self, elements: Any, recall: Any, attended: Any, selection: Selection,
                              view: HeadView) -> None:
        """A selection decode step's numbers into the cache's decode statistics (`DecodeStats.add`): `elements`
        read (the method's cost model), the top-k `recall` (or None), `attended` rows per query head."""
        raise NotImplementedError

    def observe(self, method: StepMethod, queries: torch.Tensor, step: Step) -> None:
        """The method's observation of the queries `[H_q, q, D]` the layer just attended with (the hook its layout
        asks: `observe`, or on the static layout `observe_step`)."""
        raise NotImplementedError

    def evict(self, method: StepMethod, step: Step) -> None:
        """An eviction event on this layer, to `self.budget` tokens per head: the method's choice (the hook its
        layout asks: `keep`, or on the static layout `decode_eviction_scores`) applied to the storage."""
        raise NotImplementedError

    def clone_into(self, cache: Cache) -> "KVLayer":
        """A layer for `cache` that shares this layer's buffers (see each layout's)."""
        raise NotImplementedError

