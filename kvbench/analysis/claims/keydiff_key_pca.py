"""KeyDiff §3.1 Fig. 4 and App. C.1 Figs. 5, 8-11: in a PCA picture of one head's keys, the keys KeyDiff keeps are
spread over the keys' cloud, while those Sink and TOVA keep cluster ("KeyDiff retains more varied keys"; "the
tokens retained by sink attention and TOVA tend to tightly cluster together while KeyDiff's retained tokens are
more evenly distributed"; "this observation generalizes across heads and layers").

Per sample, layer and KV head, the prompt's keys are projected on their first two principal components (App. F.1:
"we applied PCA to the key cache"; centred, from the eigenvectors of their covariance). Each policy keeps rows by
block prompt processing, as Fig. 12's claim runs it (`keydiff_key_volume.block_eviction`: KeyDiff's default score,
TOVA's group-mean attention of the block's last query, Sink's 4 sinks and recent rows; the same budget, a quarter
of the prompt, and blocks of 128, since App. F.1's numbers are lost in the text). The spread of a set of keys in
the plane is the area of its covariance ellipse, sqrt(det) of the 2 x 2 covariance of their projections, taken
relative to all the prompt's keys (1: as spread as the whole cloud). The effect of a sample is the share of
(layer, KV head) in which KeyDiff's kept keys spread the most of the three. Verdict rule: holds above one half
(the paper's "more evenly distributed" is a picture; this is kvbench's number for it).

The figure is the paper's pictures, from the first record: for the first KV head of the first, middle and last
layer (the paper's several heads and layers), each policy's kept keys over the evicted ones (Fig. 11, Figs. 8-10),
and Fig. 4's: PCA of the head's keys and its group's queries together, the keys coloured by their KeyDiff score,
the queries and the anchor (the mean key, KeyDiff's default) in the same plane. The drawn rows are thinned to
`points` evenly spaced prompt rows per head, to keep records small.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvbench.analysis.base import Claim, register_claim
from kvbench.analysis.claims.keydiff_key_volume import POLICIES, block_eviction
from kvbench.analysis.figures import new_figure
from kvbench.analysis.trace import LayerTrace, Trace
from kvbench.methods.keydiff import keydiff_scores
from kvbench.tasks.base import Sample


def pca_plane(points: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean `[D]` and the first two principal directions `[D, 2]` of `points` `[N, D]` (float64), each
    direction's sign fixed so that its largest loading is positive (the same picture on every run)."""
    x = points.double()
    mean = x.mean(dim=0)
    centred = x - mean
    _, vectors = torch.linalg.eigh(centred.T @ centred / len(x))  # ascending eigenvalues
    basis = vectors[:, [-1, -2]]
    signs = torch.sign(basis.gather(0, basis.abs().argmax(dim=0, keepdim=True)))
    return mean, basis * torch.where(signs == 0, 1.0, signs)


def spread(xy: torch.Tensor) -> float:
    """The area of the covariance ellipse of 2-D points `[N, 2]`: sqrt(det(cov)) (population covariance)."""
    centred = xy - xy.mean(dim=0)
    return float(torch.linalg.det(centred.T @ centred / len(xy)).clamp(min=0).sqrt())


def thinned_rows(n: int, points: int) -> torch.Tensor:
    """At most `points` evenly spaced rows of `n`, first and last included."""
    return torch.linspace(0, n - 1, min(n, points)).round().long().unique()


@register_claim
@dataclasses.dataclass
class KeyDiffKeyPca(Claim):
    name = "keydiff_key_pca"
    paper = "KeyDiff"
    source = "§3.1 Fig. 4, App. C.1 Figs. 5, 8-11"
    statement = ("in the PCA plane of a head's keys, the keys KeyDiff retains are spread over the cloud while Sink's "
                 "and TOVA's cluster together")
    paper_number = "PCA pictures (Llama-3.2-3B, narrativeqa's first sample): no number"
    effect_name = "share of (layer, KV head) where KeyDiff's kept keys spread the most in the PCA plane"
    threshold = 0.5
    holds_when = "above"
    budget: float = 0.25  # a share of the prompt; 1 or more: tokens per KV head (as keydiff_key_volume)
    block: int = 128
    points: int = 600  # prompt rows drawn per head

    def measure(self, trace: Trace, sample: Sample, seed: int) -> dict[str, Any]:
        n = trace.prompt_len
        budget = round(self.budget * n) if self.budget < 1 else int(self.budget)
        if budget >= n:
            raise ValueError(f"budget {budget} tokens evicts nothing from a {n}-token prompt: give a smaller budget")
        drawn_layers = sorted({0, len(trace.layers) // 2, len(trace.layers) - 1})
        spreads: dict[str, list[list[float]]] = {policy: [] for policy in POLICIES}
        drawings = []
        for index, layer in enumerate(trace.layers):
            held = {policy: block_eviction(layer, n, budget, self.block, policy) for policy in POLICIES}
            keys = layer.keys[:, :n].double()
            per_head: dict[str, list[float]] = {policy: [] for policy in POLICIES}
            for head in range(keys.shape[0]):
                mean, basis = pca_plane(keys[head])
                xy = (keys[head] - mean) @ basis
                whole = spread(xy)
                for policy in POLICIES:
                    per_head[policy].append(spread(xy[held[policy][head]]) / whole)
                if index in drawn_layers and head == 0:
                    drawings.append(self._drawing(layer, index, head, n, xy, held))
            for policy in POLICIES:
                spreads[policy].append(per_head[policy])
        table = {policy: np.asarray(v) for policy, v in spreads.items()}  # [layers, H_kv]
        largest = table["keydiff"] > np.maximum(table["tova"], table["sink"])
        return {"effect": float(largest.mean()), "budget_tokens": budget, "spreads": spreads, "drawings": drawings,
                **{f"median_spread_{policy}": float(np.median(v)) for policy, v in table.items()}}

    def _drawing(self, layer: LayerTrace, index: int, head: int, n: int, xy: torch.Tensor,
                 held: dict[str, torch.Tensor]) -> dict[str, Any]:
        """One head's picture data: its thinned keys in their PCA plane with each policy's kept flags (Fig. 11),
        and the keys, its group's queries and the anchor in the PCA plane of keys and queries (Fig. 4)."""
        rows = thinned_rows(n, self.points)
        keys = layer.keys[head, :n].double()
        queries = layer.queries[head * layer.group:(head + 1) * layer.group, :n].double().reshape(-1, keys.shape[-1])
        mean, basis = pca_plane(torch.cat([keys, queries]))
        query_rows = thinned_rows(len(queries), self.points)
        scores = keydiff_scores(layer.keys[head:head + 1, :n])[0]
        kept = {policy: torch.zeros(n, dtype=torch.bool).index_fill_(0, held[policy][head], True)[rows].tolist()
                for policy in POLICIES}

        def plane(points: torch.Tensor) -> list[list[float]]:
            return np.round(((points - mean) @ basis).numpy(), 4).tolist()

        return {"layer": index, "head": head, "keys": np.round(xy[rows].numpy(), 4).tolist(), "kept": kept,
                "joint_keys": plane(keys[rows]), "scores": np.round(scores[rows].numpy(), 4).tolist(),
                "joint_queries": plane(queries[query_rows]), "anchor": plane(keys.mean(dim=0, keepdim=True))[0]}

    def figure(self, records: Sequence[dict[str, Any]]) -> Any:
        drawings = records[0]["drawings"]
        fig, axes = new_figure(columns=len(POLICIES) + 1, width=3.4, height=3.2, rows=len(drawings))
        axes = np.asarray(axes).reshape(len(drawings), len(POLICIES) + 1)
        for row, drawing in zip(axes, drawings):
            keys = np.asarray(drawing["keys"])
            for ax, policy in zip(row, POLICIES):
                kept = np.asarray(drawing["kept"][policy], dtype=bool)
                ax.scatter(*keys[~kept].T, s=3, c="lightgray", label="evicted")
                ax.scatter(*keys[kept].T, s=3, c="tab:blue", label="kept")
                ax.set_title(f"{policy}, layer {drawing['layer']} head {drawing['head']}", fontsize=8)
            ax = row[-1]
            joint, queries = np.asarray(drawing["joint_keys"]), np.asarray(drawing["joint_queries"])
            points = ax.scatter(*joint.T, s=3, c=drawing["scores"], cmap="viridis")
            ax.scatter(*queries.T, s=3, c="tab:red", marker="x", label="queries")
            ax.scatter(*drawing["anchor"], s=80, c="black", marker="*", label="anchor (mean key)")
            fig.colorbar(points, ax=ax, label="KeyDiff score")
            ax.set_title(f"keys and queries, layer {drawing['layer']} head {drawing['head']}", fontsize=8)
        axes[0, 0].legend(fontsize=6, markerscale=3)
        axes[0, -1].legend(fontsize=6)
        fig.suptitle("KeyDiff Figs. 4, 11: PCA of one head's keys, kept and evicted", fontsize=10)
        return fig
