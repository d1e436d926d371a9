"""CTKVR Obs. 1 / Fig. 2(a): after RoPE, queries at nearby positions are highly similar; the similarity decays
with the distance, and within 1K tokens it stays above 0.8 in most datasets.

Per sample, layer and distance d in {1, 2, 4, ...} (below the prompt length): the mean cosine of post-RoPE
queries `q_p`, `q_{p+d}` of the same query head, over `positions` start positions p drawn uniformly across
the prompt (seeded) and over the heads. The curve is kept per layer (no pooling across layers in the record);
the effect is the lowest, over the distances below `within`, of the layer-mean cosine.

Verdict rule: holds when that lowest cosine is above 0.8 (the paper's "exceeds 0.8 within 1K").
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
from kvbench.analysis.trace import Trace
from kvbench.tasks.base import Sample


@register_claim
@dataclasses.dataclass
class CTKVRQuerySimilarity(Claim):
    name = "ctkvr_query_similarity"
    paper = "CTKVR"
    source = "Obs. 1, Fig. 2(a)"
    statement = "post-RoPE queries at nearby positions are highly similar (cosine > 0.8 within 1K tokens)"
    paper_number = "cosine > 0.8 for distances within 1K in most RULER datasets (Llama-3-8B)"
    effect_name = "lowest layer-mean query cosine at distances within 1K"
    threshold = 0.8
    holds_when = "above"
    positions: int = 256
    within: int = 1000

    def measure(self, trace: Trace, sample: Sample, seed: int) -> dict[str, Any]:
        n = trace.prompt_len
        distances = [2**i for i in range(13) if 2**i < n]
        gen = torch.Generator().manual_seed(seed)
        starts = {d: torch.randint(0, n - d, (self.positions,), generator=gen) for d in distances}
        curves = []
        for layer in trace.layers:
            unit = F.normalize(layer.queries[:, :n], dim=-1)
            curves.append([float((unit[:, starts[d]] * unit[:, starts[d] + d]).sum(-1).mean()) for d in distances])
        mean = np.mean(curves, axis=0)
        near = [c for d, c in zip(distances, mean) if d < self.within]
        return {"effect": float(min(near)), "distances": distances, "cosine_per_layer": curves}

    def figure(self, records: Sequence[dict[str, Any]]) -> Any:
        fig, ax = new_figure()
        distances = records[0]["distances"]
        curves = np.mean([np.asarray(r["cosine_per_layer"])[:, : len(distances)] for r in records], axis=0)
        for curve in curves:
            ax.plot(distances, curve, color="tab:blue", alpha=0.25, lw=0.8)
        ax.plot(distances, curves.mean(0), color="tab:blue", lw=2.5, label="mean over layers")
        ax.axhline(self.threshold, color="k", ls="--", lw=1, label="0.8")
        ax.axvline(self.within, color="grey", ls=":", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("position distance d")
        ax.set_ylabel("cos(q_p, q_p+d), post-RoPE")
        ax.set_title("CTKVR Fig. 2(a): query similarity vs distance")
        ax.legend(fontsize=8)
        return fig
