"""Dense prefills kept for reuse: eviction after a dense prefill does not change it, so one prefill per prompt
serves every method and budget of a sweep.

The engine keeps no store of its own: whoever decides what is shared owns one and passes it to
`engine.sample.run_group` / `run_sample`. The run layer keeps one per process (`run.caches.prefill_snapshots`),
so the points of a local multirun share their prefills; a call without one gets a private store."""

from __future__ import annotations

from collections import OrderedDict

import torch

from kvbench.cache.kvcache import KVBenchCache


class PrefillSnapshots:
    """LRU of dense prefills (per-layer K/V, captured window queries, last logits), bounded in bytes."""

    def __init__(self, limit_mb: int):
        self.limit = limit_mb * 2**20
        self.entries: OrderedDict[tuple, tuple[KVBenchCache, torch.Tensor, float, int]] = OrderedDict()

    def get(self, key: tuple) -> tuple[KVBenchCache, torch.Tensor, float] | None:
        if key not in self.entries:
            return None
        self.entries.move_to_end(key)
        cache, logits, seconds, _ = self.entries[key]
        return cache, logits, seconds

    def put(self, key: tuple, cache: KVBenchCache, logits: torch.Tensor, seconds: float) -> None:
        size = cache.nbytes()
        if size > self.limit:
            return
        self.entries[key] = (cache, logits, seconds, size)
        while sum(e[3] for e in self.entries.values()) > self.limit:
            self.entries.popitem(last=False)

