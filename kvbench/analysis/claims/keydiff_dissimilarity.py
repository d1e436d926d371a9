"""KeyDiff §3.1 / Fig. 2: keys that are less similar to the other keys receive more attention, whatever the
query (the observation behind an attention-free eviction score).

Per sample and (layer, KV head), over the prompt's keys before the last `queries` positions: the KeyDiff score
of each key (`kvbench.methods.keydiff.keydiff_scores`, the method's own anchor: minus the cosine to the mean
key) and the attention it receives, averaged over the last `queries` prompt queries and the group's query
heads (the window's own keys are left out: not every window query sees them). Spearman's rho between the
key's cosine to the anchor and its attention; the paper's claim is a negative correlation. The effect is the
share of heads with rho < 0.

Verdict rule: holds when that share is above one half (KeyDiff §3.1 states the correlation without a share of
heads; one half is kvbench's threshold).
The record also carries the mean attention of the least and most similar deciles.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvbench.analysis.base import Claim, register_claim
from kvbench.analysis.figures import new_figure
from kvbench.analysis.trace import Trace, spearman
from kvbench.methods.keydiff import keydiff_scores
from kvbench.tasks.base import Sample


@register_claim
@dataclasses.dataclass
class KeyDiffDissimilarity(Claim):
    name = "keydiff_dissimilarity"
    paper = "KeyDiff"
    source = "§3.1, Fig. 2"
    statement = "a key's cosine similarity to the other keys correlates negatively with the attention it receives"
    paper_number = "negative correlation in the heads shown (Llama-3.1-8B); no rate over heads given"
    effect_name = "share of heads with Spearman(cosine to anchor, attention) < 0"
    threshold = 0.5
    holds_when = "above"
    queries: int = 128
    anchor: str = "mean_raw"

    def measure(self, trace: Trace, sample: Sample, seed: int) -> dict[str, Any]:
        n = trace.prompt_len
        window = min(self.queries, n // 2)
        keys_before = n - window
        rhos, low_decile, high_decile = [], [], []
        for layer in trace.layers:
            rows = layer.rows(torch.arange(keys_before, n), keys_upto=n)[..., :keys_before]
            received = rows.mean(1).view(layer.keys.shape[0], layer.group, -1).mean(1)  # [H_kv, n - w]
            cosine = -keydiff_scores(layer.keys[:, :keys_before], self.anchor)  # [H_kv, n - w]
            layer_rhos = []
            for c, a in zip(cosine, received):
                layer_rhos.append(spearman(c, a))
                order = c.argsort()
                tenth = max(1, len(order) // 10)
                low_decile.append(float(a[order[:tenth]].mean()))
                high_decile.append(float(a[order[-tenth:]].mean()))
            rhos.append(layer_rhos)
        flat = torch.tensor(rhos, dtype=torch.float64).flatten()
        return {"effect": float((flat < 0).double().mean()), "rho_per_head": rhos,
                "attention_least_similar_decile": float(np.mean(low_decile)),
                "attention_most_similar_decile": float(np.mean(high_decile))}

    def figure(self, records: Sequence[dict[str, Any]]) -> Any:
        fig, (hist, bars) = new_figure(2)
        rhos = [rho for r in records for layer in r["rho_per_head"] for rho in layer]
        hist.hist(rhos, bins=30, range=(-1, 1))
        hist.axvline(0, color="k", ls="--", lw=1)
        hist.set_xlabel("Spearman(cosine to mean key, attention received)")
        hist.set_ylabel("heads x samples")
        hist.set_title("KeyDiff: similarity vs attention, per head")
        low = np.mean([r["attention_least_similar_decile"] for r in records])
        high = np.mean([r["attention_most_similar_decile"] for r in records])
        bars.bar(["least similar 10%", "most similar 10%"], [low, high])
        bars.set_ylabel("mean attention received")
        return fig
