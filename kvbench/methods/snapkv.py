"""SnapKV (Li et al. 2024) in the GQA-aware form used by Ada-KV and RocketKV.

The last `window` prompt queries (the observation window) score every earlier key: softmax attention
(fp32, causal inside the window), averaged over the window queries, aggregated over the query heads of each
KV group (`gqa_agg`: mean, the Ada-KV default, or max), then smoothed along the sequence with a 1-D pool
(`pooling`, `kernel`). Each KV head keeps its top `budget - window` tokens by pooled score plus the whole
window, in original order.

Defaults follow the Ada-KV reference framework (window 32, max-pool kernel 7, group mean) so that SnapKV and
Ada-SnapKV differ only in budget allocation. The original SnapKV code uses average pooling; set
`pooling=avg` for it. RocketKV's stage 1 uses kernel 63 with window sums (sum and mean rank identically).
When `budget <= window` the head keeps only the last `budget` tokens (the window no longer fits).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvbench.methods.base import Method, register_method


def window_scores(obs_queries: torch.Tensor, keys: torch.Tensor, scaling: float, gqa_agg: str = "mean") -> torch.Tensor:
    """Window-mean attention of the observation queries to the keys before the window.

    obs_queries: [H_q, w, D] (the last w queries of the segment); keys: [H_kv, L, D]. Returns [H_kv, L - w]
    in fp32. Query head h*G + g belongs to KV head h (transformers' repeat_kv order).
    """
    n_q, w, dim = obs_queries.shape
    n_kv, length, _ = keys.shape
    group = n_q // n_kv
    q = obs_queries.float().reshape(n_kv, group * w, dim)
    logits = torch.bmm(q, keys.float().transpose(1, 2)).mul_(scaling).view(n_kv, group, w, length)
    # window query i sits at position length - w + i and must not see later window keys
    row = torch.arange(w, device=keys.device)[:, None]
    col = torch.arange(length, device=keys.device)[None, :]
    logits.masked_fill_(col > length - w + row, float("-inf"))
    probs = torch.softmax(logits, dim=-1)[..., : length - w].mean(dim=2)  # [H_kv, G, L - w]
    if gqa_agg == "mean":
        return probs.mean(dim=1)
    if gqa_agg == "max":
        return probs.amax(dim=1)
    raise ValueError(f"gqa_agg must be mean or max, not {gqa_agg!r}")


def pool_scores(scores: torch.Tensor, pooling: str, kernel: int) -> torch.Tensor:
    if kernel <= 1:
        return scores
    if pooling == "max":
        return F.max_pool1d(scores[:, None], kernel, stride=1, padding=kernel // 2)[:, 0]
    if pooling == "avg":
        return F.avg_pool1d(scores[:, None], kernel, stride=1, padding=kernel // 2)[:, 0]
    raise ValueError(f"pooling must be max or avg, not {pooling!r}")


def with_window(top: torch.Tensor, length: int, window: int) -> torch.Tensor:
    """Sorted kept indices: the chosen ones plus the last `window` positions."""
    tail = torch.arange(length - window, length, device=top.device)
    return torch.cat([top.sort().values, tail])


@register_method
@dataclass
class SnapKV(Method):
    name = "snapkv"
    family = "eviction"
    window: int = 32
    kernel: int = 7
    pooling: str = "max"
    gqa_agg: str = "mean"

    @property
    def obs_window(self) -> int:
        return self.window

    def pooled_scores(self, layer, obs_queries: torch.Tensor, window: int) -> torch.Tensor:
        keys = layer.head_view().keys
        scores = window_scores(obs_queries[:, -window:], keys, layer.scaling, self.gqa_agg)
        return pool_scores(scores, self.pooling, self.kernel)

    def prefill_keep(self, layer, obs_queries, budget):
        length = layer.physical_length()
        if budget >= length:
            return None
        window = min(self.window, budget)
        if window == budget:
            tail = torch.arange(length - window, length, device=layer.keys.device)
            return [tail] * layer.num_heads
        scores = self.pooled_scores(layer, obs_queries, window)
        top = scores.topk(budget - window, dim=-1).indices
        return [with_window(t, length, window) for t in top]
