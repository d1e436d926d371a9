"""KeyDiff (Park et al. 2025, "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference in
Resource-Constrained Environments"): evict by key geometry alone, block-wise by default.

Per layer and KV head, an anchor is computed from all stored keys (the old cache plus the new block), each
key is scored by its dissimilarity to it, and the `budget` most dissimilar keys are kept
(KeyDiff §3.2, Eq. 7, and its sliding-window variant). No attention weights are needed, so it works with any
attention kernel.

- `anchor`: `mean_raw` (mean of the post-RoPE keys; the main text's "unnormalized keys", §3.2;
  the default), `mean_normalized` (mean of the unit keys: ranks exactly as `pairwise`, kvpress's choice),
  `pairwise` (Eq. 7, the n x n cosine matrix, O(n^2 d): a reference), `median` (coordinate-wise median).
- `metric`: `cosine` (score -cos(k, a)), `dot` (-k.a) or `euclidean` (||k - a||, keep the farthest).
- `window_ratio`: share of the budget reserved for the most recent tokens (Table 13: 0.1, 0.2; off by default).
- Schedule: the paper's block prompt processing, `block_size=128` (kvpress's BlockPress default; the number
  is lost from the paper text) and eviction after every generated token (`decode_every` null -> 1), so no head
  ever holds more than budget + 128 tokens. `block_size=null` is the one-shot variant (Table 9).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvbench.methods.base import ScoredEviction, register_method

ANCHORS = ("mean_raw", "mean_normalized", "pairwise", "median")
METRICS = ("cosine", "dot", "euclidean")


def keydiff_scores(keys: torch.Tensor, anchor: str = "mean_raw", metric: str = "cosine",
                   valid: torch.Tensor | None = None) -> torch.Tensor:
    """Scores `[H, L]` (higher = keep) of keys `[H, L, D]`, in fp32 (bf16 ties can flip top-k decisions).
    `valid` [H, L] (a static layer's capacity): the anchor is over the valid keys only."""
    k = keys.float()
    if valid is not None:
        return _masked_keydiff_scores(k, anchor, metric, valid)
    if anchor == "pairwise":
        if metric != "cosine":
            raise ValueError("the pairwise anchor (Eq. 7) is defined for the cosine metric only")
        unit = F.normalize(k, dim=-1)
        return -(unit @ unit.transpose(1, 2)).sum(dim=-1)
    if anchor == "mean_raw":
        a = k.mean(dim=1, keepdim=True)
    elif anchor == "mean_normalized":
        a = F.normalize(k, dim=-1).mean(dim=1, keepdim=True)
    elif anchor == "median":
        a = k.median(dim=1, keepdim=True).values
    else:
        raise ValueError(f"anchor must be one of {', '.join(ANCHORS)}, not {anchor!r}")
    return _dissimilarity(k, a, metric)


def _dissimilarity(k: torch.Tensor, a: torch.Tensor, metric: str) -> torch.Tensor:
    if metric == "cosine":
        return -F.cosine_similarity(k, a, dim=-1)
    if metric == "dot":
        return -(k * a).sum(dim=-1)
    if metric == "euclidean":
        return (k - a).norm(dim=-1)
    raise ValueError(f"metric must be one of {', '.join(METRICS)}, not {metric!r}")


def _masked_keydiff_scores(k: torch.Tensor, anchor: str, metric: str, valid: torch.Tensor) -> torch.Tensor:
    """`keydiff_scores` over the valid keys of `[H, L, D]` (fixed shapes: the static layout's decode eviction)."""
    weight = valid[..., None].to(k.dtype)
    count = weight.sum(dim=1, keepdim=True)
    if anchor == "pairwise":
        unit = F.normalize(k, dim=-1) * weight
        return -(unit @ unit.transpose(1, 2)).sum(dim=-1)
    if anchor == "mean_raw":
        a = (k * weight).sum(dim=1, keepdim=True) / count
    elif anchor == "mean_normalized":
        a = (F.normalize(k, dim=-1) * weight).sum(dim=1, keepdim=True) / count
    elif anchor == "median":
        a = k.masked_fill(~valid[..., None], float("nan")).nanmedian(dim=1, keepdim=True).values
    else:
        raise ValueError(f"anchor must be one of {', '.join(ANCHORS)}, not {anchor!r}")
    return _dissimilarity(k, a, metric)


@register_method
@dataclass
class KeyDiff(ScoredEviction):
    name = "keydiff"
    block_size: int | None = 128
    anchor: str = "mean_raw"
    metric: str = "cosine"
    window_ratio: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.anchor not in ANCHORS:
            raise ValueError(f"anchor must be one of {', '.join(ANCHORS)}, not {self.anchor!r}")
        if self.metric not in METRICS:
            raise ValueError(f"metric must be one of {', '.join(METRICS)}, not {self.metric!r}")
        if self.anchor == "pairwise" and self.metric != "cosine":
            raise ValueError("the pairwise anchor (Eq. 7) is defined for the cosine metric only")
        if not 0 <= self.window_ratio <= 1:
            raise ValueError(f"window_ratio must be in [0, 1], got {self.window_ratio!r}")

    def score(self, layer, step):
        view = layer.head_view()
        # the anchor over the held keys: a static layer's capacity masks its empty slots (an eager layer's uniform
        # heads have no mask, `valid` None)
        return keydiff_scores(view.keys, self.anchor, self.metric, view.valid)

    def recent_tokens(self, budget):
        return round(self.window_ratio * budget)
