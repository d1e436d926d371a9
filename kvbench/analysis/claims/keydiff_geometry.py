"""KeyDiff App. C, Fig. 14: the mean key and the mean query of a head point in opposite directions, in all
heads (with Fig. 13's "most keys and queries lie close to their means" and Fig. 15's tightly clustered
norms, the geometry behind KeyDiff's score).

Per sample and (layer, KV head): the cosine between the mean post-RoPE key and the mean post-RoPE query of the
group, over the prompt; also the median cosine of keys to their mean and of queries to theirs, and the
coefficient of variation of key and query norms (KeyDiff App. C.3, Figs. 13-15). The effect is the share of heads with a
negative mean-key/mean-query cosine.

Verdict rule: "across all heads" is read as at least 90% of heads.
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
class KeyDiffGeometry(Claim):
    name = "keydiff_geometry"
    paper = "KeyDiff"
    source = "App. C, Fig. 14"
    statement = "mean keys and mean queries have negative cosine similarity across all heads"
    paper_number = "negative in all heads (Llama-3.2-3B)"
    effect_name = "share of heads with cos(mean key, mean query) < 0"
    threshold = 0.9
    holds_when = "above"

    def measure(self, trace: Trace, sample: Sample, seed: int) -> dict[str, Any]:
        n = trace.prompt_len
        cosines, key_spread, query_spread, key_cv, query_cv = [], [], [], [], []
        for layer in trace.layers:
            keys = layer.keys[:, :n]
            queries = layer.queries[:, :n].reshape(keys.shape[0], layer.group * n, -1)
            mean_k, mean_q = keys.mean(1), queries.mean(1)
            cosines.append(F.cosine_similarity(mean_k, mean_q, dim=-1).tolist())
            key_spread.append(float(F.cosine_similarity(keys, mean_k[:, None], dim=-1).median()))
            query_spread.append(float(F.cosine_similarity(queries, mean_q[:, None], dim=-1).median()))
            for norms, out in ((keys.norm(dim=-1), key_cv), (queries.norm(dim=-1), query_cv)):
                out.append(float((norms.std(1) / norms.mean(1)).mean()))
        flat = torch.tensor(cosines, dtype=torch.float64).flatten()
        return {"effect": float((flat < 0).double().mean()), "mean_key_query_cosine": cosines,
                "median_key_cosine_to_mean": float(np.mean(key_spread)),
                "median_query_cosine_to_mean": float(np.mean(query_spread)),
                "key_norm_cv": float(np.mean(key_cv)), "query_norm_cv": float(np.mean(query_cv))}

    def figure(self, records: Sequence[dict[str, Any]]) -> Any:
        fig, ax = new_figure()
        cosines = np.mean([np.asarray(r["mean_key_query_cosine"]) for r in records], axis=0)  # [layers, H_kv]
        for h in range(cosines.shape[1]):
            ax.plot(range(cosines.shape[0]), cosines[:, h], "o", ms=4, label=f"KV head {h}")
        ax.axhline(0, color="k", ls="--", lw=1)
        ax.set_xlabel("layer")
        ax.set_ylabel("cos(mean key, mean query)")
        ax.set_title("KeyDiff Fig. 14: mean key vs mean query")
        ax.legend(fontsize=7, ncol=2)
        return fig
