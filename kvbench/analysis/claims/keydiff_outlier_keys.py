"""KeyDiff App. C.3, Fig. 16: the keys farthest in angle from the mean key are aligned with the mean query, which
is what gives them large attention weights (the mechanism behind an attention-free eviction score).

Per sample and (layer, KV head), over the prompt: each key's cosine to the mean query of the group's query heads,
cos(k_j, mean q), averaged over the top 1% of keys by KeyDiff's score (the farthest in angle from the mean key)
and over the rest. The effect is the share of heads where the top keys are the more aligned. The record also
carries, per head, Spearman's rho between cos(k_j, mean k) and cos(k_j, mean q) over every key (expected
negative too; KeyDiff App. C.3's sentence on Fig. 16 is about the farthest keys, which is what the verdict reads).

Verdict rule: "for all attention heads" (App. C.3's summary) is read as at least 90% of heads, as
keydiff_geometry reads it.
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
from kvbench.methods.keydiff import keydiff_scores
from kvbench.tasks.base import Sample


@register_claim
@dataclasses.dataclass
class KeyDiffOutlierKeys(Claim):
    name = "keydiff_outlier_keys"
    paper = "KeyDiff"
    source = "App. C.3, Fig. 16"
    statement = "the keys farthest in angle from the mean key are the ones aligned with the mean query"
    paper_number = "shown for the heads of Llama-3.2-3B; stated for all heads"
    effect_name = "share of heads where KeyDiff's top keys are more aligned with the mean query than the rest"
    threshold = 0.9
    holds_when = "above"
    top_share: float = 0.01  # KeyDiff's top keys whose alignment with the mean query is recorded

    def measure(self, trace: Trace, sample: Sample, seed: int) -> dict[str, Any]:
        n = trace.prompt_len
        rhos, top_alignment, rest_alignment = [], [], []
        top = max(1, round(self.top_share * n))
        for layer in trace.layers:
            keys = layer.keys[:, :n].float()
            mean_q = layer.queries[:, :n].reshape(keys.shape[0], layer.group * n, -1).float().mean(1)
            to_key = F.cosine_similarity(keys, keys.mean(1, keepdim=True), dim=-1)  # [H_kv, n]
            to_query = F.cosine_similarity(keys, mean_q[:, None], dim=-1)
            outliers = keydiff_scores(keys).topk(top, dim=-1).indices
            chosen = torch.zeros_like(to_query, dtype=torch.bool).scatter_(1, outliers, True)
            rhos.append([spearman(to_key[h], to_query[h]) for h in range(keys.shape[0])])
            top_alignment.append(to_query.masked_fill(~chosen, 0).sum(1).div(top).tolist())
            rest_alignment.append(to_query.masked_fill(chosen, 0).sum(1).div(n - top).tolist())
        aligned = np.asarray(top_alignment) > np.asarray(rest_alignment)
        negative = np.asarray(rhos, dtype=np.float64) < 0
        return {"effect": float(aligned.mean()), "share_negative_spearman": float(negative.mean()),
                "spearman": rhos, "top_keys": top,
                "top_cos_to_mean_query": top_alignment, "rest_cos_to_mean_query": rest_alignment}

    def figure(self, records: Sequence[dict[str, Any]]) -> Any:
        fig, ax = new_figure()
        top = np.concatenate([np.asarray(r["top_cos_to_mean_query"]).ravel() for r in records])
        rest = np.concatenate([np.asarray(r["rest_cos_to_mean_query"]).ravel() for r in records])
        ax.scatter(rest, top, s=8)
        low, high = float(min(rest.min(), top.min())), float(max(rest.max(), top.max()))
        ax.plot([low, high], [low, high], "k--", lw=1)
        ax.set_xlabel("mean cos(k, mean query): the other keys")
        ax.set_ylabel(f"mean cos(k, mean query): KeyDiff's top {self.top_share:.0%}")
        ax.set_title("KeyDiff Fig. 16: outlier keys and the mean query, per head")
        return fig
