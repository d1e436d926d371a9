"""OmniKV §3 (Insights): decode attention is sparse: beyond the first layers a few percent of the
prompt's tokens hold most of it, while layers 0-1 are markedly less sparse (why OmniKV keeps them dense).

Per sample, layer, decode step and query head: the share of the prompt's tokens whose largest attention weights
hold `mass` of the step's attention on the prompt (the decode steps of a full-cache greedy answer); averaged
over heads and steps per layer. The effect is the median over layers >= 2 of that share.

Verdict rule: holds when the share is below 10% ("~5-10% of prompt tokens hold most of the attention") and
layers 0-1 need at least twice the median share of the others ("markedly less sparse").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvbench.analysis.base import Claim, register_claim
from kvbench.analysis.figures import new_figure
from kvbench.analysis.trace import Trace, share_for_mass
from kvbench.tasks.base import Sample

DENSE_PREFIX = 2


@register_claim
@dataclasses.dataclass
class OmniKVSparsity(Claim):
    name = "omnikv_sparsity"
    paper = "OmniKV"
    source = "§3, Fig. 1(b)"
    statement = "beyond the first layers, a few percent of the prompt holds most of the decode attention"
    paper_number = "~5-10% of tokens hold > 80-90% of the attention; layers 0-1 less sparse (Llama-3-8B-262K)"
    effect_name = "median over layers >= 2 of the prompt share holding the mass"
    threshold = 0.10
    holds_when = "below"
    mass: float = 0.9
    new_tokens: int = 32

    def measure(self, trace: Trace, sample: Sample, seed: int) -> dict[str, Any]:
        if len(trace.layers) <= DENSE_PREFIX:
            raise ValueError(f"needs more than {DENSE_PREFIX} layers (layers 0-{DENSE_PREFIX - 1} are compared with the rest)")
        n = trace.prompt_len
        shares = [float(share_for_mass(layer.rows(trace.decode_queries)[..., :n], self.mass).mean())
                  for layer in trace.layers]
        later = shares[DENSE_PREFIX:]
        return {"effect": float(np.median(later)), "share_per_layer": shares,
                "first_layers_share": float(np.mean(shares[:DENSE_PREFIX]))}

    def condition(self, records: Sequence[dict[str, Any]]) -> tuple[bool, str]:
        first = float(np.mean([r["first_layers_share"] for r in records]))
        later = float(np.mean([r["effect"] for r in records]))
        return first >= 2 * later, f"layers 0-1 need >= 2x that share (measured {first:.3f} vs {later:.3f})"

    def figure(self, records: Sequence[dict[str, Any]]) -> Any:
        fig, ax = new_figure()
        shares = np.mean([r["share_per_layer"] for r in records], axis=0)
        colours = ["tab:orange" if i < DENSE_PREFIX else "tab:blue" for i in range(len(shares))]
        ax.bar(range(len(shares)), shares * 100, color=colours)
        ax.axhline(self.threshold * 100, color="k", ls="--", lw=1)
        ax.set_xlabel("layer")
        ax.set_ylabel(f"% of prompt holding {self.mass:.0%} of decode attention")
        ax.set_title("OmniKV: decode attention sparsity per layer")
        return fig
