"""Ada-KV (Feng et al., NeurIPS 2025): head-wise adaptive budget allocation, here on SnapKV (Ada-SnapKV).

Per layer, with b = budget - window outside-window slots per KV head and h KV heads:

1. SnapKV's pooled window scores `a` ([h, n], n = L - window; GQA group mean, max-pool kernel 7).
2. Algorithm 1: the global top-(h*b) entries of `a` over all heads of the layer; head i wins f_i of them.
3. Safeguard: B_i = (1 - alpha) * f_i + alpha * b, so each head keeps at least alpha*b slots. This is the
   authors' code semantics; the paper's Algorithm 2 prints the opposite weighting, which is `alpha=0.8`
   here. The real-valued B_i are rounded by largest remainder so that sum(B_i) = h*b exactly
   (the code's plain `round` can miss by a few tokens; specs/adakv.md §8.4).
4. Head i keeps its own top-B_i tokens plus the window. Heads then hold different numbers of tokens and the
   cache stores them ragged (flattened per layer), so the memory is really freed.

`alpha=0` gives plain Algorithm 1 (the retained attention mass is then the global optimum, Thm 3.3).

`allocation=kvpress` is NVIDIA kvpress's `AdaKVPress` rule instead, to reproduce its published numbers: each
head's top int(alpha * budget) tokens by score (the window, scored above everything, included) are
protected, then the layer keeps its global top H * budget scores. Its floor is weaker than the authors'
(alpha of the whole budget, window included, rather than alpha of the budget outside the window on top of
the window), and the adaptive part is chosen after the protected tokens.

Block-wise or decode-time eviction (`block_size`, `decode_every`, not in the paper) re-runs the allocation on
the ragged layer: the layer's total stays H * budget, each head's window is its own last `window` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench.methods.base import EvictionMethod, register_method
from kvbench.methods.snapkv import SnapKV, with_window


def allocate(scores: torch.Tensor, total: int, alpha: float, capacity: list[int] | None = None) -> list[int]:
    """Per-head budgets for `total` slots over `scores` [h, n] (Algorithm 1 plus the alpha safeguard).

    `capacity` caps each head at its number of candidates when heads hold different numbers of tokens
    (re-eviction of a ragged layer after a block or a decode step; -inf scores mark the missing ones): a
    capped head's excess goes to the heads that won the most slots among those with room, so the sum stays
    `total`. After a single dense prefill no cap ever binds.
    """
    heads, n = scores.shape
    won = torch.bincount(scores.reshape(-1).topk(total).indices // n, minlength=heads).double()
    target = (1 - alpha) * won + alpha * (total / heads)
    budgets = target.floor()
    short = total - int(budgets.sum())
    if short:
        # largest remainder; ties go to the lower head index (stable sort) for determinism
        order = torch.sort(target - budgets, descending=True, stable=True).indices[:short]
        budgets[order] += 1
    result = [int(b) for b in budgets]
    if capacity is not None:
        excess = sum(max(0, b - c) for b, c in zip(result, capacity))
        result = [min(b, c) for b, c in zip(result, capacity)]
        for h in torch.sort(won, descending=True, stable=True).indices.tolist():
            extra = min(excess, capacity[h] - result[h])
            result[h] += extra
            excess -= extra
    return result


def with_window_scores(scores: torch.Tensor, lens: list[int], window: int) -> torch.Tensor:
    """Candidate scores [h, n] extended to every stored token [h, max len]: each head's window +inf."""
    out = torch.full((len(lens), max(lens)), float("-inf"), device=scores.device)
    for h, n in enumerate(lens):
        out[h, : n - window] = scores[h, : n - window]
        out[h, n - window: n] = float("inf")
    return out


def allocate_kvpress(scores: torch.Tensor, budget: int, alpha: float) -> list[torch.Tensor]:
    """kvpress's AdaKVPress: per head, the sorted indices it keeps out of `scores` [h, L] (the window scored
    +inf, missing entries of a ragged layer -inf): protect each head's top int(alpha * budget), then keep the
    layer's global top h * budget."""
    heads, length = scores.shape
    protected = scores.topk(min(int(alpha * budget), length), dim=-1).indices
    scores = scores.scatter(-1, protected, float("inf"))
    kept = scores.reshape(-1).topk(heads * budget).indices.sort().values
    return [kept[kept // length == h] % length for h in range(heads)]  # sorted flat rows: sorted per head


@register_method
@dataclass
class AdaKV(EvictionMethod):
    """Ada-KV's allocation around SnapKV's scores (`scorer`). The fields stay flat (the YAML's); `window`,
    `kernel`, `pooling`, `gqa_agg` and `granularity` are the scorer's and are checked there."""

    name = "adakv"
    ragged_layers = True
    window: int = 32
    kernel: int = 7
    pooling: str = "max"
    gqa_agg: str = "mean"
    granularity: str | None = None
    alpha: float = 0.2
    allocation: str | None = None  # authors (null): (1 - alpha) f_i + alpha b, the Ada-KV code; kvpress: AdaKVPress

    def __post_init__(self) -> None:
        super().__post_init__()
        self.scorer = SnapKV(window=self.window, kernel=self.kernel, pooling=self.pooling, gqa_agg=self.gqa_agg,
                             granularity=self.granularity)
        self.granularity = self.scorer.granularity
        if self.granularity != "group":
            raise ValueError("adakv allocates per KV head: granularity must be group")
        self.allocation = self.allocation or "authors"
        if self.allocation not in ("authors", "kvpress"):
            raise ValueError(f"allocation must be authors or kvpress, not {self.allocation!r}")
        if not 0 <= self.alpha <= 1:
            raise ValueError(f"alpha (the per-head floor, a fraction of the uniform budget) must be in [0, 1], "
                             f"got {self.alpha!r}")

    @property
    def obs_window(self) -> int:
        return self.window

    def keep(self, layer, budget, step):
        lens = layer.lengths()
        if budget * len(lens) >= sum(lens):
            return None
        window = min(self.window, budget)
        if window == budget:
            return [torch.arange(n - window, n, device=layer.keys.device) for n in lens]
        scores = self.scorer.pooled_scores(layer, window)
        if self.allocation == "kvpress":
            return allocate_kvpress(with_window_scores(scores, lens, window), budget, self.alpha)
        capacity = [n - window for n in lens] if layer.is_ragged else None
        per_head = allocate(scores, (budget - window) * scores.shape[0], self.alpha, capacity)
        return [with_window(s.topk(b).indices, n, window) for s, b, n in zip(scores, per_head, lens)]
