"""OmniKV Fig. 1(c): the tokens that matter change across decode steps. A static set chosen at prefill (H2O's
heavy hitters, the 25% of prompt tokens with the most accumulated attention) misses tokens that later steps
attend to strongly: the attention falling outside it spikes.

Per sample and layer: the static set is H2O's at the end of prefill, `keep` of the prompt's tokens: the most
recent `recent_ratio` of them plus the heavy hitters, the tokens with the most attention accumulated over
every prompt query (head mean). `recent_ratio` = 0.5 is the original H2O's half-and-half split; 0 keeps heavy
hitters alone, and then the step's attention to the prompt's last tokens (the question) dominates what is
missed (on SmolLM2 / 2StageRetr: 0.46 at the first step, against 0.03-0.05 with the split). Per decode step (a full-cache greedy
answer): the head-mean attention on prompt tokens outside that set, as a share of the step's attention on the
prompt, averaged over layers >= 2. The effect is the largest such share over the steps (the spike).

Verdict rule: holds when the largest missed share is above 10%: at some step, a tenth of the attention lands
on tokens eviction after prefill would have dropped. The paper gives no number, only the spikes.
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

FIRST_LAYER = 2
CHUNK = 256


@register_claim
@dataclasses.dataclass
class OmniKVStaticSet(Claim):
    name = "omnikv_static_set"
    paper = "OmniKV"
    source = "Fig. 1(c)"
    statement = "attention missed by a static prefill token set (H2O top-25%) spikes at some decode steps"
    paper_number = "spikes of missed attention across decode steps (multi-hop QA); no value given"
    effect_name = "largest per-step attention share outside the static set"
    threshold = 0.10
    holds_when = "above"
    keep: float = 0.25
    recent_ratio: float = 0.5
    new_tokens: int = 32

    def measure(self, trace: Trace, sample: Sample, seed: int) -> dict[str, Any]:
        if len(trace.layers) <= FIRST_LAYER:
            raise ValueError(f"needs more than {FIRST_LAYER} layers (the first {FIRST_LAYER} are OmniKV's dense prefix)")
        n = trace.prompt_len
        missed = []
        for layer in trace.layers[FIRST_LAYER:]:
            accumulated = torch.zeros(n, dtype=torch.float64)
            for start in range(0, n, CHUNK):
                accumulated += layer.rows(torch.arange(start, min(n, start + CHUNK)), keys_upto=n).sum((0, 1)).double()
            budget = max(1, round(self.keep * n))
            recent = round(self.recent_ratio * budget)
            kept = torch.zeros(n, dtype=torch.bool)
            kept[n - recent:] = True
            kept[accumulated[: n - recent].topk(budget - recent).indices] = True
            decode = layer.rows(trace.decode_queries)[..., :n].mean(0).double()  # [steps, n]
            missed.append((decode[:, ~kept].sum(-1) / decode.sum(-1)).tolist())
        per_step = np.mean(missed, axis=0)
        return {"effect": float(per_step.max()), "missed_per_step": per_step.tolist(),
                "mean_missed": float(per_step.mean())}

    def figure(self, records: Sequence[dict[str, Any]]) -> Any:
        fig, ax = new_figure()
        for i, record in enumerate(records):
            ax.plot(record["missed_per_step"], lw=1, label=f"sample {i}" if i < 8 else None)
        ax.axhline(self.threshold, color="k", ls="--", lw=1)
        ax.set_xlabel("decode step")
        ax.set_ylabel(f"attention outside the prefill top-{self.keep:.0%}")
        ax.set_title("OmniKV Fig. 1(c): attention missed by a static set")
        ax.legend(fontsize=7)
        return fig
