"""StreamingLLM (Xiao et al. 2024): attention sinks plus the most recent tokens.

Per KV head keep the first `n_sink` tokens and the last `budget - n_sink` stored ones. By default eviction
happens once at the end of the compressed segment and the cache then grows by one token per step, as in the
Ada-KV / kvpress evaluation framework (Ada-KV §4.1). `decode_every=1` is the paper's rolling window
(the cache stays at the budget while generating); `block_size` runs it under block prompt processing as the
KeyDiff paper's Sink baseline.

Against the release (mit-han-lab/streaming-llm, `decode_every=1`) on the same tensors, and what its
positions inside the cache change: docs/fidelity.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench.methods.base import EvictionMethod, register_method


@register_method
@dataclass
class StreamingLLM(EvictionMethod):
    name = "streamingllm"
    n_sink: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_sink < 0:
            raise ValueError(f"n_sink must be a number of tokens >= 0, got {self.n_sink!r}")

    def decode_eviction_scores(self, layer, budget, step):
        """The rolling window on the static layout: the oldest token that is not a sink goes. The sinks are the
        first slots, which the window never overwrites."""
        positions = layer.head_view().positions.float()
        sinks = torch.arange(positions.shape[1], device=positions.device) < min(self.n_sink, budget)
        return positions.masked_fill(sinks[None, :], float("inf")), budget

    def keep(self, layer, budget, step):
        length = layer.physical_length()
        if budget >= length:
            return None
        sink = min(self.n_sink, budget)
        idx = torch.cat([torch.arange(sink), torch.arange(length - (budget - sink), length)])
        return [idx.to(layer.keys.device)] * layer.num_heads
