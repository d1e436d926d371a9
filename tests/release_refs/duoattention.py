"""DuoAttention's head split and streaming cache as its release computes them: mit-han-lab/duo-attention, commit
fe93c314ae87306ef6629dc16713250b4718ffe7.

- `release_retrieval_heads`: `load_attn_pattern` and `sparsify_attention_heads` (`duo_attn/utils.py`) as
  `eval/LongBench/pred.py` calls them after `seed_everything(42)`: the gates read with `np.loadtxt`, clipped to
  [0, 1], plus `np.random.uniform(0, 1e-6)` from the global generator (its first draw after the seed), the
  threshold `np.quantile(gates, sparsity)` (1: every head streams, 0: none), heads at or above it retrieve.
- `streaming_kept`: `DuoAttentionStaticKVCache.compress_and_replace_streaming_kv`
  (`duo_attn/patch/static_kv_cache.py`): a streaming head holding more than `sink + recent` tokens keeps its
  first `sink` and last `recent`; a retrieval head keeps all.
"""

from __future__ import annotations

import numpy as np


def release_retrieval_heads(tsv_path, sparsity: float, seed: int = 42) -> np.ndarray:
    """Bool `[layers, kv_heads]`: the release's retrieval heads for `sparsity`."""
    np.random.seed(seed)
    gates = np.clip(np.loadtxt(tsv_path, dtype=float, delimiter="\t"), 0, 1)
    gates = gates + np.random.uniform(0, 1e-6, gates.shape)
    threshold = np.quantile(gates, sparsity)
    if sparsity >= 1:
        threshold = 2
    if sparsity <= 0:
        threshold = -1
    return gates >= threshold


def streaming_kept(length: int, sink: int, recent: int) -> list[int]:
    if length <= sink + recent:
        return list(range(length))
    return list(range(sink)) + list(range(length - recent, length))
