"""Ada-KV Fig. 1 / Fig. 12: heads differ in how concentrated their attention is. Most heads hold nearly all
their attention in about 5% of the cache; a minority of dispersed heads need far more.

Per sample and query head: the window attention (the last `window` prompt queries, SnapKV's observation
window, averaged) over the tokens before the window; the share of those tokens whose largest weights hold
`mass` of it; and the head's curve of mass against the top share (the paper's "aggregated top ratio" heatmap,
0-50%). The effect is the median head's share.

Verdict rule: holds when the median head needs at most 5% of the tokens ("most heads reach ~1.0 with ~5% of
entries") and the heads are heterogeneous: on average at least one head in twenty needs 20% or more (Ada-KV
Fig. 1's "dispersed heads ... need significant larger cache proportions"; the paper gives no share, the 20% is
kvbench's threshold).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvbench.analysis.base import Claim, register_claim
from kvbench.analysis.figures import new_figure
from kvbench.analysis.trace import Trace, share_for_mass
from kvbench.tasks.base import Sample

TOP_RATIOS = [i / 100 for i in range(0, 51, 2)]
DISPERSED = 0.2


@register_claim
@dataclasses.dataclass
class AdaKVConcentration(Claim):
    name = "adakv_concentration"
    paper = "Ada-KV"
    source = "Fig. 1"
    statement = "most heads concentrate their attention on ~5% of the cache; a minority is dispersed"
    paper_number = "most heads reach ~1.0 of the weight with ~5% of entries (Llama-3.1-8B); some need far more"
    effect_name = "median head's token share for the mass"
    threshold = 0.05
    holds_when = "below"
    window: int = 32
    mass: float = 0.95

    def measure(self, trace: Trace, sample: Sample, seed: int) -> dict[str, Any]:
        n = trace.prompt_len
        window = min(self.window, n - 1)
        queries = torch.arange(n - window, n)
        shares, curves = [], []
        for layer in trace.layers:
            weights = layer.rows(queries, keys_upto=n)[..., : n - window].mean(1)  # [H_q, n - w]
            shares.append(share_for_mass(weights, self.mass).tolist())
            ordered = weights.sort(-1, descending=True).values.cumsum(-1) / weights.sum(-1, keepdim=True)
            at = [max(0, min(ordered.shape[-1], round(r * ordered.shape[-1])) - 1) for r in TOP_RATIOS]
            curves.append([[0.0 if r == 0 else float(row[i]) for r, i in zip(TOP_RATIOS, at)] for row in ordered])
        flat = torch.tensor(shares, dtype=torch.float64).flatten()
        return {"effect": float(flat.median()), "share_per_head": shares, "dispersed_share":
                float((flat >= DISPERSED).double().mean()), "mass_curves": curves}

    def condition(self, records: Sequence[dict[str, Any]]) -> tuple[bool, str]:
        dispersed = float(np.mean([r["dispersed_share"] for r in records]))
        return dispersed >= 0.05, f"at least 5% of heads need >= {DISPERSED:.0%} of the tokens (measured {dispersed:.1%})"

    def figure(self, records: Sequence[dict[str, Any]]) -> Any:
        fig, (heat, hist) = new_figure(2)
        curves = np.mean([np.asarray(r["mass_curves"]) for r in records], axis=0)  # [layers, H_q, ratios]
        image = heat.imshow(curves.reshape(-1, curves.shape[-1]), aspect="auto", cmap="viridis", vmin=0.45, vmax=1,
                            extent=(0, 50, curves.shape[0] * curves.shape[1], 0), interpolation="nearest")
        heat.set_xlabel("aggregated top ratio (% of cache)")
        heat.set_ylabel("head (layer-major)")
        heat.set_title("Ada-KV Fig. 1/12: weight in each head's top entries")
        fig.colorbar(image, ax=heat)
        shares = [s for r in records for layer in r["share_per_head"] for s in layer]
        hist.hist(np.asarray(shares) * 100, bins=40)
        hist.set_xlabel(f"% of cache holding {self.mass:.0%} of the window attention")
        hist.set_ylabel("heads x samples")
        hist.axvline(5, color="k", ls="--", lw=1)
        return fig
