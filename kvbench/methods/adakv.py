"""Ada-KV (Feng et al., NeurIPS 2025): head-wise adaptive budget allocation, here on SnapKV (Ada-SnapKV).

Per layer, with b = budget - window outside-window slots per KV head and h KV heads:

1. SnapKV's pooled window scores `a` ([h, n], n = L - window; GQA group mean, max-pool kernel 7).
2. Algorithm 1: the global top-(h*b) entries of `a` over all heads of the layer; head i wins f_i of them.
3. Safeguard: B_i = (1 - alpha) * f_i + alpha * b, so each head keeps at least alpha*b slots. This is the
   authors' code (and kvpress) semantics; the paper's Algorithm 2 prints the opposite weighting, which is
   `alpha=0.8` here. The real-valued B_i are rounded by largest remainder so that sum(B_i) = h*b exactly
   (the code's plain `round` can miss by a few tokens; specs/adakv.md §8.4).
4. Head i keeps its own top-B_i tokens plus the window. Heads then hold different numbers of tokens and the
   cache stores them ragged (flattened per layer), so the memory is really freed.

`alpha=0` gives plain Algorithm 1 (the retained attention mass is then the global optimum, Thm 3.3).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench.methods.base import register_method
from kvbench.methods.snapkv import SnapKV, with_window


def allocate(scores: torch.Tensor, total: int, alpha: float) -> list[int]:
    """Per-head budgets for `total` slots over `scores` [h, n] (Algorithm 1 plus the alpha safeguard)."""
    heads, n = scores.shape
    won = torch.bincount(scores.reshape(-1).topk(total).indices // n, minlength=heads).double()
    target = (1 - alpha) * won + alpha * (total / heads)
    budgets = target.floor()
    short = total - int(budgets.sum())
    if short:
        # largest remainder; ties go to the lower head index (stable sort) for determinism
        order = torch.sort(target - budgets, descending=True, stable=True).indices[:short]
        budgets[order] += 1
    return [int(b) for b in budgets]


@register_method
@dataclass
class AdaKV(SnapKV):
    name = "adakv"
    alpha: float = 0.2

    def prefill_keep(self, layer, obs_queries, budget):
        length = layer.physical_length()
        if budget >= length:
            return None
        window = min(self.window, budget)
        if window == budget:
            return super().prefill_keep(layer, obs_queries, budget)
        scores = self.pooled_scores(layer, obs_queries, window)
        per_head = allocate(scores, (budget - window) * scores.shape[0], self.alpha)
        return [with_window(s.topk(b).indices, length, window) for s, b in zip(scores, per_head)]
