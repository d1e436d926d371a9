"""The KV cache: per-layer storage in which every KV head may hold a different set of tokens.

Storage layout (batch size 1, as in the Ada-KV and RocketKV reference code):

- *uniform*: every KV head holds the same number of tokens; `keys`/`values` are `[1, H_kv, L, D]` and
  `positions` is `[H_kv, L]`. Full cache and uniform eviction (StreamingLLM, SnapKV) live here, and the
  uncompressed attention path is exactly the stock SDPA call.
- *ragged*: heads hold different numbers of tokens (Ada-KV). `keys`/`values` are flattened to
  `[sum_h len_h, D]` with `head_lens` (the official Ada-KV layout, `cu_seqlens` style), so evicted
  tokens are really freed rather than padded.

`positions` holds each stored token's logical position; RoPE has already been applied to the keys, so
positions only serve analysis (which tokens survived) and rollback (`truncate`). `seen` counts logical
tokens, and `get_seq_length()` reports it, so transformers' default positions stay right after eviction
(the engine passes explicit `position_ids` anyway).

Eviction always builds new tensors with `gather`/`index_select`: a slice would keep the whole original
storage alive. Nothing mutates a stored tensor in place, so a prefill snapshot can be shared by several
caches (see `kvbench.engine.PrefillSnapshots`).
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

if TYPE_CHECKING:
    from kvbench.methods.base import Method

_active = threading.local()


def active_layer(key: torch.Tensor) -> "KVLayer | None":
    """The layer whose `update` returned `key`, i.e. the layer the model is attending with right now.

    The identity check catches a forward that silently used a cache of its own (transformers creates a
    DynamicCache when none is passed): the pointer would otherwise refer to a stale layer.
    """
    layer = getattr(_active, "layer", None)
    if layer is None or layer.returned_key is None or layer.returned_key() is not key:
        return None
    return layer


@dataclass
class HeadView:
    """A padded `[H_kv, L_max, D]` view of a layer plus a validity mask (None when no padding)."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor  # [H_kv, L_max], -1 on padding
    valid: torch.Tensor | None  # [H_kv, L_max] bool


class KVLayer(CacheLayerMixin):
    is_compileable = False  # a True value makes generate() build 4D masks and auto-compile
    is_sliding = False
    is_croppable = False

    def __init__(self, layer_idx: int, cache: "KVBenchCache"):
        super().__init__()
        self.layer_idx = layer_idx
        self.cache = cache
        self.positions: torch.Tensor | None = None
        self.head_lens: list[int] | None = None  # None: uniform layout
        self.seen = 0
        self.obs_queries: torch.Tensor | None = None  # [H_q, w, D] captured for deferred eviction
        # weak, so that the tensor handed to the model never keeps evicted storage alive
        self.returned_key: weakref.ref | None = None
        self.scaling: float | None = None  # set by the attention function; eviction scores need it
        self.evicted = False

    # -- transformers' layer protocol -------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.num_heads, self.head_dim = key_states.shape[1], key_states.shape[-1]
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if key_states.shape[0] != 1:
            raise ValueError("KVBenchCache supports batch size 1 (as the Ada-KV and RocketKV reference code)")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q = key_states.shape[2]
        new_pos = torch.arange(self.seen, self.seen + q, dtype=torch.int32, device=key_states.device)
        if self.keys is None:
            self.keys, self.values = key_states.contiguous(), value_states.contiguous()
            self.positions = new_pos.expand(self.num_heads, q).contiguous()
        elif self.head_lens is None:
            self.keys = torch.cat([self.keys, key_states], dim=2)
            self.values = torch.cat([self.values, value_states], dim=2)
            self.positions = torch.cat([self.positions, new_pos.expand(self.num_heads, q)], dim=1)
        else:
            self._append_ragged(key_states[0], value_states[0], new_pos)
        self.seen += q
        self.returned_key = weakref.ref(self.keys)
        _active.layer = self
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
        return self.head_lens is not None

    def lengths(self) -> list[int]:
        if self.keys is None:
            return []
        return list(self.head_lens) if self.is_ragged else [self.keys.shape[2]] * self.num_heads

    def physical_length(self) -> int:
        return max(self.lengths(), default=0)

    def _offsets(self) -> torch.Tensor:
        lens = torch.tensor(self.head_lens, device=self.keys.device)
        return torch.cumsum(lens, 0) - lens  # start row of each head

    def _append_ragged(self, k: torch.Tensor, v: torch.Tensor, new_pos: torch.Tensor) -> None:
        # One new flat tensor: each head's old rows shift down by q rows per preceding head.
        q, heads = k.shape[1], self.num_heads
        lens = torch.tensor(self.head_lens, device=k.device)
        head_of_row = torch.repeat_interleave(torch.arange(heads, device=k.device), lens)
        old_dest = torch.arange(int(lens.sum()), device=k.device) + head_of_row * q
        new_starts = torch.cumsum(lens + q, 0) - q
        new_dest = (new_starts[:, None] + torch.arange(q, device=k.device)[None, :]).reshape(-1)
        total = int(lens.sum()) + heads * q
        keys = self.keys.new_empty(total, self.head_dim)
        values = self.values.new_empty(total, self.head_dim)
        positions = self.positions.new_empty(total)
        keys[old_dest], values[old_dest], positions[old_dest] = self.keys, self.values, self.positions
        keys[new_dest] = k.reshape(-1, self.head_dim)
        values[new_dest] = v.reshape(-1, self.head_dim)
        positions[new_dest] = new_pos.repeat(heads)
        self.keys, self.values, self.positions = keys, values, positions
        self.head_lens = [n + q for n in self.head_lens]

    def head_view(self) -> HeadView:
        """Keys/values as `[H_kv, L_max, D]`: a free view when uniform, a padded copy when ragged."""
        if not self.is_ragged:
            return HeadView(self.keys[0], self.values[0], self.positions, None)
        lens = torch.tensor(self.head_lens, device=self.keys.device)
        width = int(lens.max())
        slot = torch.arange(width, device=lens.device)[None, :]
        valid = slot < lens[:, None]
        rows = (self._offsets()[:, None] + slot).clamp(max=self.keys.shape[0] - 1)
        positions = torch.where(valid, self.positions[rows], torch.full_like(self.positions[rows], -1))
        return HeadView(self.keys[rows], self.values[rows], positions, valid)

    def keep(self, indices: list[torch.Tensor]) -> None:
        """Keep, per KV head, the tokens at `indices[h]` (positions in the head's current storage)."""
        view = self.head_view()
        sizes = {int(ix.numel()) for ix in indices}
        if len(sizes) == 1:
            idx = torch.stack([ix.to(view.keys.device) for ix in indices])  # [H, k]
            gather = idx[:, :, None].expand(-1, -1, self.head_dim)
            self.keys = view.keys.gather(1, gather).unsqueeze(0)
            self.values = view.values.gather(1, gather).unsqueeze(0)
            self.positions = view.positions.gather(1, idx)
            self.head_lens = None
        else:
            self.keys = torch.cat([view.keys[h].index_select(0, ix) for h, ix in enumerate(indices)])
            self.values = torch.cat([view.values[h].index_select(0, ix) for h, ix in enumerate(indices)])
            self.positions = torch.cat([view.positions[h].index_select(0, ix) for h, ix in enumerate(indices)])
            self.head_lens = [int(ix.numel()) for ix in indices]
        self.evicted = True

    def truncate(self, logical_length: int) -> None:
        """Drop every stored token whose logical position is >= `logical_length` (multi-turn rollback)."""
        view = self.head_view()
        keep = [torch.nonzero((p >= 0) & (p < logical_length)).flatten() for p in view.positions]
        if any(int(ix.numel()) != n for ix, n in zip(keep, self.lengths())):
            self.keep(keep)
        self.seen = logical_length

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.keys, self.values, self.positions, self.obs_queries) if t is not None]


class KVBenchCache(Cache):
    """A transformers Cache whose layers implement kvbench's storage and call the method's hooks.

    `compress_on_forward` is set by the engine for the one forward pass that ends the segment to compress;
    the attention function then runs the method's eviction hook on each layer right after that layer's
    prefill attention (so at peak only one layer holds its full KV, as in the reference implementations).
    With `capture_window > 0` the layers instead keep their last queries and eviction runs later via
    `compress`, which lets one dense prefill serve many methods and budgets.
    """

    def __init__(self, num_layers: int, method: "Method | None" = None, budget: int | None = None):
        super().__init__(layers=[KVLayer(i, self) for i in range(num_layers)])
        self.method = method
        self.budget = budget  # tokens per KV head, resolved by the engine; None: no eviction
        self.compress_on_forward = False
        self.capture_window = 0
        self.select_budget: int | None = None  # decode-time selection budget (tokens per head)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def nbytes(self) -> int:
        """Bytes of the distinct storages this cache holds: what eviction really freed, not a mask count."""
        seen: dict[int, int] = {}
        for layer in self.layers:
            for t in layer.tensors():
                storage = t.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
        return sum(seen.values())

    def kv_bytes(self) -> int:
        """Bytes of keys and values alone (without positions or captured queries)."""
        return sum(layer.keys.untyped_storage().nbytes() + layer.values.untyped_storage().nbytes()
                   for layer in self.layers if layer.keys is not None)

    def kept_per_head(self) -> list[list[int]]:
        return [layer.lengths() for layer in self.layers]

    def truncate(self, logical_length: int) -> None:
        for layer in self.layers:
            layer.truncate(logical_length)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].seen if self.layers else 0

    def compress(self) -> None:
        """Deferred eviction: run the method's prefill hook on every layer from the captured queries."""
        from kvbench.attention import evict_layer

        for layer in self.layers:
            evict_layer(layer, layer.obs_queries)
            layer.obs_queries = None
        self.capture_window = 0

    def clone(self) -> "KVBenchCache":
        """A copy that shares the (never mutated in place) tensors: costs no memory until it diverges."""
        twin = KVBenchCache(self.num_layers, self.method, self.budget)
        twin.select_budget = self.select_budget
        for mine, theirs in zip(self.layers, twin.layers):
            theirs.__dict__.update({k: v for k, v in mine.__dict__.items() if k != "cache"})
            theirs.cache = twin
            theirs.head_lens = list(mine.head_lens) if mine.head_lens is not None else None
        return twin
