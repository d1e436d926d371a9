"""`BatchedCache`: several `KVBenchCache`s decoded in one forward, one per batch row, and rows of padding."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvbench.cache.kvcache import KVBenchCache
from kvbench.cache.layer import KVLayer


class BatchedCache(Cache):
    """Several `KVBenchCache`s decoded as one batch: row b of every forward is `caches[b]`.

    Each row keeps its own storage (uniform or ragged), statistics and accounting (and, through its `Step`,
    its own method, plan and hooks); the model's dense layers run once over all rows, so a decode step reads the
    weights once for all of them, and the attention function attends row by row, each on its own layer (the
    `Step` of its row). Rows may hold different lengths (positions are passed per row).

    A row whose cache is None is padding (`kvbench.engine.session.step_batch` pads a forward to its row block so
    that the dense layers multiply as many rows alone as in a batch): it stores nothing and attends to nothing.
    """

    def __init__(self, caches: list[KVBenchCache | None]):
        real = [c for c in caches if c is not None]
        if not real or len({c.num_layers for c in real}) != 1:
            raise ValueError("a batch needs one or more caches of the same model")
        super().__init__(layers=[_BatchedLayer([c.layers[i] if c is not None else None for c in caches])
                                 for i in range(real[0].num_layers)])
        self.caches = caches

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(c.get_seq_length(layer_idx) for c in self.caches if c is not None)


class _BatchedLayer(CacheLayerMixin):
    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self, rows: list[KVLayer | None]):
        super().__init__()
        self.rows = rows
        self.real = [layer for layer in rows if layer is not None]
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if key_states.shape[0] != len(self.rows):
            raise ValueError(f"a batch of {key_states.shape[0]} rows for {len(self.rows)} caches")
        for b, layer in enumerate(self.rows):
            if layer is not None:
                layer.update(key_states[b:b + 1], value_states[b:b + 1])
        return key_states, value_states

    def get_seq_length(self) -> int:
        return max(layer.seen for layer in self.real)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return max(layer.physical_length() for layer in self.real), 0

    def get_max_length(self) -> int:
        return -1
