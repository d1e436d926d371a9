"""CTKVR §3.1.2 (footnote 6) and App. C.2, Fig. 13: the deduplication coefficient alpha, the share of the
C' * rho recalled list entries that are distinct keys, "typically equals 0.5 or less" and "remains consistently
below 0.5" across rho, C and C' (Fig. 13 varies one at a time around rho = 2560, C = 1024, C' = 4).

Per sample and layer, CTKVR's own code builds the qcIVF over the prompt (`kvbench.methods.ctkvr.build_index`:
the last C post-RoPE queries as centroids, C = min(`centroids`, s / 16), each listing its top-rho keys among the
host rows [n_init, s - n_local), n_local = max(C, 5% of s) as the method's default) and recalls for every decode
query of the full-cache greedy answer (`CTKVR._recall`: the top-C' centroids by cosine, their lists' union
without duplicates). alpha = the distinct rows per KV head / (C' * rho), averaged over KV heads, steps and
layers. The index stays as the prompt built it (no DCU), so this is alpha at the first decode steps; rho is
capped at the host rows of a short prompt.

Verdict rule: holds when the sample-mean alpha is below 0.5.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvbench.analysis.base import Claim, register_claim
from kvbench.analysis.figures import new_figure
from kvbench.analysis.trace import Trace
from kvbench.methods.ctkvr import CTKVR, QueryIndex, build_index, centroid_count, default_local
from kvbench.tasks.base import Sample


@register_claim
@dataclasses.dataclass
class CTKVRDedupAlpha(Claim):
    name = "ctkvr_dedup_alpha"
    paper = "CTKVR"
    source = "§3.1.2, App. C.2, Fig. 13"
    statement = "the recalled lists overlap: the deduplication coefficient alpha is 0.5 or less"
    paper_number = "alpha below 0.5 in most configurations (rho = 2560, C = 1024, C' = 4 and one varied)"
    effect_name = "alpha: distinct recalled keys / (C' * rho)"
    threshold = 0.5
    holds_when = "below"
    rho: int = 2560  # keys per centroid's list (2.5 rho', rho' = 1024)
    centroids: int = 1024  # C, at most s / 16 (CTKVR's rule)
    retrieved: int = 4  # C'
    n_init: int = 64
    new_tokens: int = 16

    def measure(self, trace: Trace, sample: Sample, seed: int) -> dict[str, Any]:
        n = trace.prompt_len
        count = centroid_count(self.centroids, n)
        n_local = default_local(count, n)
        host_rows = n - n_local - self.n_init
        if host_rows < 1:
            raise ValueError(f"a {n}-token prompt is all initial and local tokens: nothing to recall from")
        rho = min(self.rho, host_rows)
        retrieved = min(self.retrieved, count)
        steps = trace.decode_queries
        per_layer = []
        for layer in trace.layers:
            heads, _, dim = layer.keys.shape
            positions = torch.arange(n).expand(heads, -1)
            host = (positions >= self.n_init) & (positions < n - n_local)
            queries = layer.queries[:, n - count:n]
            lists = build_index(queries, torch.arange(n - count, n), layer.keys[:, :n], positions, host, rho,
                                layer.scaling, chunk=256)
            index = QueryIndex(queries, lists)
            alphas = []
            for p in steps.tolist():
                _, valid = CTKVR._recall(layer.queries[:, p].view(heads, layer.group, dim), index, retrieved)
                alphas.append(float(valid.sum(dim=1).float().mean()) / (rho * retrieved))
            per_layer.append(float(np.mean(alphas)))
        return {"effect": float(np.mean(per_layer)), "alpha_per_layer": per_layer, "rho": rho, "centroids": count,
                "retrieved": retrieved, "decode_steps": len(steps)}

    def figure(self, records: Sequence[dict[str, Any]]) -> Any:
        fig, ax = new_figure()
        alphas = np.asarray([r["alpha_per_layer"] for r in records])  # [samples, layers]
        ax.plot(range(alphas.shape[1]), alphas.mean(axis=0), "o-", label="mean over samples")
        ax.axhline(0.5, color="k", ls="--", lw=1, label="0.5")
        ax.set_xlabel("layer")
        ax.set_ylabel("alpha (distinct / C' * rho)")
        first = records[0]
        ax.set_title(f"CTKVR Fig. 13: alpha at rho={first['rho']}, C={first['centroids']}, C'={first['retrieved']}")
        ax.set_ylim(0, 1)
        ax.legend(fontsize=8)
        return fig
