"""StreamingLLM (Xiao et al. 2024): attention sinks plus the most recent tokens.

Per KV head keep the first `n_sink` tokens and the last `budget - n_sink` of the compressed segment. As in
the Ada-KV / KVPress evaluation framework (specs/adakv.md §2.5), eviction happens once at the end of prefill
and the cache then grows by one token per step; the rolling decode-time window of the original paper needs
decode-time eviction, which arrives with H2O/KeyDiff.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench.methods.base import Method, register_method


@register_method
@dataclass
class StreamingLLM(Method):
    name = "streamingllm"
    family = "eviction"
    n_sink: int = 4

    def prefill_keep(self, layer, obs_queries, budget):
        length = layer.physical_length()
        if budget >= length:
            return None
        sink = min(self.n_sink, budget)
        idx = torch.cat([torch.arange(sink), torch.arange(length - (budget - sink), length)])
        return [idx.to(layer.keys.device)] * layer.num_heads
