"""KV storage: per-head row buffers with append slack, copy on write between clones, byte accounting."""

from kvbench.cache.batched import BatchedCache
from kvbench.cache.dynamic import DynamicKVLayer
from kvbench.cache.kvcache import DecodeStats, KVBenchCache
from kvbench.cache.layer import KVLayer
from kvbench.cache.static import StaticKVLayer

__all__ = ["BatchedCache", "DecodeStats", "DynamicKVLayer", "KVBenchCache", "KVLayer", "StaticKVLayer"]
