"""OmniKV Fig. 1(a) / Fig. 8: inter-layer attention similarity. Within one decode step, the tokens one layer
attends to most keep most of the attention of the layers after it (what lets a few "filter" layers choose
the tokens of the others).

Per sample, decode step and layer j: the head-mean attention row `a_j` of the step's query (the decode
steps of a full-cache greedy answer). With T_i the top-k tokens of `a_i`, S(i -> j) = sum of `a_j` over T_i
(the paper's measure; the authors' script uses the head mean too). Kept for every pair i < j, averaged over
steps, with the oracle S(j -> j) and a random baseline (k random tokens with the same sink tokens, the first
four positions, as T_i). The effect is the mean of S(i -> j) / S(j -> j) over i >= 2 (OmniKV keeps the first
layers dense) and j in (i, i + 8].

Verdict rule: holds when that ratio is above 0.75 (the paper's "exceptionally high" similarity; its
example keeps 0.87 of layer 20's attention with layer 8's top-2048) and the random baseline's ratio is below
half of it (far above chance).
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
from kvbench.tasks.base import Sample

SINKS = 4
SPAN = 8
FIRST_FILTER = 2


def head_mean_decode_rows(trace: Trace) -> torch.Tensor:
    """`[layers, steps, L]`: each decode step's head-mean attention row, per layer."""
    steps = trace.decode_queries
    return torch.stack([layer.rows(steps).mean(0) for layer in trace.layers])


@register_claim
@dataclasses.dataclass
class OmniKVInterLayer(Claim):
    name = "omnikv_interlayer"
    paper = "OmniKV"
    source = "Fig. 1(a), Fig. 8"
    statement = "a layer's important tokens keep most of the attention of the following layers within a decode step"
    paper_number = "S(8 -> 20) = 0.87 with top-2048 (Llama-3-8B-262K, HotpotQA)"
    effect_name = "mean S(i -> j) / S(j -> j) over i >= 2, j in (i, i + 8]"
    threshold = 0.75
    holds_when = "above"
    k: float = 0.05  # tokens in T_i; below 1 a share of the tokens the step sees
    new_tokens: int = 32

    def measure(self, trace: Trace, sample: Sample, seed: int) -> dict[str, Any]:
        if len(trace.layers) < FIRST_FILTER + 2:
            raise ValueError(f"needs at least {FIRST_FILTER + 2} layers (layers 0-{FIRST_FILTER - 1} are OmniKV's dense prefix)")
        rows = head_mean_decode_rows(trace)  # [layers, steps, L]
        layers, steps, length = rows.shape
        gen = torch.Generator().manual_seed(seed)
        similarity = torch.zeros(layers, layers, dtype=torch.float64)
        random_mass = torch.zeros(layers, layers, dtype=torch.float64)
        for s, position in enumerate(trace.decode_queries.tolist()):
            visible = position + 1
            k = max(1, round(self.k * visible)) if self.k < 1 else min(int(self.k), visible)
            step = rows[:, s, :visible].double()  # [layers, visible]
            top = step.topk(k, dim=-1).indices  # [layers, k]
            similarity += torch.stack([step[:, t].sum(-1) for t in top])  # [i, j] = S(i -> j)
            for i in range(layers):
                sinks = top[i][top[i] < SINKS]
                others = torch.randperm(max(visible - SINKS, 0), generator=gen)[: k - len(sinks)] + SINKS
                random_mass[i] += step[:, torch.cat([sinks, others])].sum(-1)
        similarity /= steps
        random_mass /= steps
        oracle = similarity.diagonal()
        pairs = [(i, j) for i in range(FIRST_FILTER, layers) for j in range(i + 1, min(layers, i + SPAN + 1))]
        ratio = [float(similarity[i, j] / oracle[j]) for i, j in pairs]
        chance = [float(random_mass[i, j] / oracle[j]) for i, j in pairs]
        return {"effect": float(np.mean(ratio)), "random_ratio": float(np.mean(chance)),
                "similarity": similarity.tolist(), "decode_steps": steps}

    def condition(self, records: Sequence[dict[str, Any]]) -> tuple[bool, str]:
        effect = float(np.mean([r["effect"] for r in records]))
        chance = float(np.mean([r["random_ratio"] for r in records]))
        return chance < effect / 2, f"a random set's ratio is below half of it (random {chance:.3f})"

    def figure(self, records: Sequence[dict[str, Any]]) -> Any:
        fig, ax = new_figure(height=4.6, width=5.2)
        matrix = np.mean([np.asarray(r["similarity"]) for r in records], axis=0)
        image = ax.imshow(matrix, cmap="viridis", vmin=0, vmax=1, interpolation="nearest")
        ax.set_xlabel("layer j")
        ax.set_ylabel("layer i (selects T_i)")
        ax.set_title("OmniKV Fig. 8: S(i -> j), attention of j on T_i")
        fig.colorbar(image, ax=ax)
        return fig
