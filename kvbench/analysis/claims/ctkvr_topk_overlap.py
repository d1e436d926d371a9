"""CTKVR Obs. 2 / Fig. 2(b): queries that are similar retrieve overlapping top-k keys.

Per sample and layer: `pairs` query pairs (p, p') at positions drawn uniformly across the prompt (after its
first eighth, so the search space is not tiny), each with a random query head; their cosine and the overlap
|S ∩ S'| / k of their top-k keys by q·k over the keys both can see (positions up to min(p, p')), with k the
`k_fraction` of that prefix (the paper: top-5K at long contexts). Spearman's rho of cosine against overlap per
layer, not pooled across layers (layers differ in both, which can make a pooled correlation say what no
layer does); the effect is the median layer's rho.

Verdict rule: holds when that rho is above 0 (the paper's "clear positive correlation").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from kvbench.analysis.base import Claim, register_claim
from kvbench.analysis.figures import new_figure
from kvbench.analysis.trace import Trace, spearman
from kvbench.tasks.base import Sample


@register_claim
@dataclasses.dataclass
class CTKVRTopKOverlap(Claim):
    name = "ctkvr_topk_overlap"
    paper = "CTKVR"
    source = "Obs. 2, Fig. 2(b)"
    statement = "similar queries retrieve overlapping top-k keys (overlap rises with query cosine)"
    paper_number = "clear positive trend of top-5K overlap against query cosine (two RULER datasets)"
    effect_name = "median layer's Spearman(query cosine, top-k overlap)"
    threshold = 0.0
    holds_when = "above"
    pairs: int = 128
    k_fraction: float = 0.05

    def measure(self, trace: Trace, sample: Sample, seed: int) -> dict[str, Any]:
        n = trace.prompt_len
        gen = torch.Generator().manual_seed(seed)
        rhos, cosines, overlaps = [], [], []
        for layer in trace.layers:
            first = torch.randint(n // 8, n, (self.pairs,), generator=gen)
            second = torch.randint(n // 8, n, (self.pairs,), generator=gen)
            heads = torch.randint(0, layer.queries.shape[0], (self.pairs,), generator=gen)
            layer_cos, layer_overlap = [], []
            for p, p2, h in zip(first.tolist(), second.tolist(), heads.tolist()):
                if p == p2:
                    continue
                visible = min(p, p2) + 1
                k = max(1, round(self.k_fraction * visible))
                keys = layer.keys[h // layer.group, :visible]
                top = (keys @ layer.queries[h, p]).topk(k).indices
                top2 = (keys @ layer.queries[h, p2]).topk(k).indices
                layer_overlap.append(len(set(top.tolist()) & set(top2.tolist())) / k)
                layer_cos.append(float(F.cosine_similarity(layer.queries[h, p], layer.queries[h, p2], dim=0)))
            rhos.append(spearman(torch.tensor(layer_cos), torch.tensor(layer_overlap)))
            cosines.append(layer_cos)
            overlaps.append(layer_overlap)
        valid = [r for r in rhos if not np.isnan(r)]  # a layer whose overlaps are all equal has no rank order
        return {"effect": float(np.median(valid)) if valid else 0.0,
                "rho_per_layer": [None if np.isnan(r) else r for r in rhos],
                "pair_cosine": cosines, "pair_overlap": overlaps}

    def figure(self, records: Sequence[dict[str, Any]]) -> Any:
        fig, (scatter, bars) = new_figure(2)
        cos = np.array([c for r in records for layer in r["pair_cosine"] for c in layer])
        overlap = np.array([o for r in records for layer in r["pair_overlap"] for o in layer])
        scatter.scatter(cos, overlap, s=3, alpha=0.3)
        if len(cos) > 1 and np.ptp(cos) > 0:
            slope, intercept = np.polyfit(cos, overlap, 1)
            xs = np.linspace(cos.min(), cos.max(), 2)
            scatter.plot(xs, slope * xs + intercept, "r-", label=f"fit: slope {slope:.2f}")
            scatter.legend(fontsize=8)
        scatter.set_xlabel("query cosine")
        scatter.set_ylabel(f"top-{self.k_fraction:.0%} key overlap")
        scatter.set_title("CTKVR Fig. 2(b): overlap vs query similarity")
        rhos = np.nanmean([[np.nan if v is None else v for v in r["rho_per_layer"]] for r in records], axis=0)
        bars.bar(range(len(rhos)), rhos)
        bars.axhline(0, color="k", lw=1)
        bars.set_xlabel("layer")
        bars.set_ylabel("Spearman rho (per layer)")
        return fig
