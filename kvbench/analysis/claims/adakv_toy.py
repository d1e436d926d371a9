"""Ada-KV Fig. 2: the worked example. Three heads of six attention weights each and a layer budget of six:
uniform allocation (two per head) keeps 2.26 of the weight, Algorithm 1 (the layer's top six, wherever they
fall) gives the heads 4, 1 and 1 slots and keeps 2.48.

It runs kvbench's own allocation (`kvbench.methods.adakv.allocate`, alpha = 0), so it checks the code the
method runs, not a copy. Verdict rule: holds when both retained weights equal the paper's to 1e-9 and the
allocation is [4, 1, 1]; the effect is the retained-weight gain (0.22 in the paper). No model and no samples.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from kvbench.analysis.base import Claim, register_claim
from kvbench.analysis.figures import new_figure
from kvbench.methods.adakv import allocate

WEIGHTS = [[0.32, 0.01, 0.18, 0.08, 0.22, 0.19], [0.89, 0.01, 0.05, 0.02, 0.01, 0.02],
           [0.68, 0.01, 0.08, 0.04, 0.09, 0.10]]
PAPER_UNIFORM, PAPER_ADAPTIVE, PAPER_ALLOCATION = 2.26, 2.48, [4, 1, 1]


@register_claim
@dataclasses.dataclass
class AdaKVToy(Claim):
    name = "adakv_toy"
    paper = "Ada-KV"
    source = "Fig. 2"
    statement = "adaptive allocation retains more attention weight than uniform allocation at the same budget"
    paper_number = "uniform 2.26, adaptive 2.48 (allocation [4, 1, 1]), B = 6"
    effect_name = "retained weight, adaptive minus uniform"
    threshold = 0.0
    holds_when = "above"
    needs_samples = False
    budget: int = 6

    def measure_once(self) -> dict[str, Any]:
        weights = torch.tensor(WEIGHTS, dtype=torch.float64)
        heads = weights.shape[0]
        allocation = allocate(weights, self.budget, alpha=0.0)
        uniform = sum(float(w.topk(self.budget // heads).values.sum()) for w in weights)
        adaptive = sum(float(w.topk(b).values.sum()) for w, b in zip(weights, allocation))
        return {"sample_id": "toy", "effect": adaptive - uniform, "uniform": uniform, "adaptive": adaptive,
                "allocation": allocation}

    def condition(self, records: Sequence[dict[str, Any]]) -> tuple[bool, str]:
        record = records[0]
        exact = (abs(record["uniform"] - PAPER_UNIFORM) < 1e-9 and abs(record["adaptive"] - PAPER_ADAPTIVE) < 1e-9
                 and record["allocation"] == PAPER_ALLOCATION)
        return exact, "uniform = 2.26, adaptive = 2.48 and allocation = [4, 1, 1] exactly"

    def figure(self, records: Sequence[dict[str, Any]]) -> Any:
        record = records[0]
        fig, ax = new_figure()
        weights = torch.tensor(WEIGHTS, dtype=torch.float64)
        heads = range(1, len(WEIGHTS) + 1)
        uniform = [float(w.topk(self.budget // len(WEIGHTS)).values.sum()) for w in weights]
        adaptive = [float(w.topk(b).values.sum()) for w, b in zip(weights, record["allocation"])]
        ax.bar([h - 0.2 for h in heads], uniform, 0.4, label=f"uniform (2 each): {record['uniform']:.2f}")
        ax.bar([h + 0.2 for h in heads], adaptive, 0.4,
               label=f"adaptive {record['allocation']}: {record['adaptive']:.2f}")
        ax.set_xticks(list(heads), [f"head {h}" for h in heads])
        ax.set_ylabel("retained attention weight")
        ax.set_title(f"Ada-KV Fig. 2: toy example, B = {self.budget}")
        ax.legend(fontsize=8)
        return fig
