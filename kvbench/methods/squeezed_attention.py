"""Squeezed Attention (Hooper et al. 2024, arXiv 2411.09688; github.com/SqueezeAILab/SqueezedAttention): keys
clustered once, looked up by centroid at every decode step. The baseline of CTKVR's Table 10 (App. B.4).

When the prompt's prefill ends, per layer and KV head (the release's `run_clustering`):

- the prompt's keys but its last `window` (the release's observation window, 100) are clustered by cosine
  similarity: k-means over the L2-normalised keys, C = `percent_clusters`% of them (the release's PC5: 5%),
  at most `kmeans_iterations` Lloyd iterations (CTKVR App. B.4.2: "up to 300 iterations in practice"),
  stopping early once no assignment changes;
- each cluster's centroid for the lookup is the mean of its raw keys (not of the normalised ones), and the
  keys' labels and the clusters' sizes n_k are kept.

Every decode step, per query head (the release's `_pytorch_centroid_lookup` and its Triton kernel): each
cluster's estimated attention probability is S_k = exp(s q.c_k) / sum_j n_j exp(s q.c_j), the softmax over
the keys as if every key were its centroid; a clustered key scores its cluster's S. The release keeps the
keys whose S passes a threshold calibrated offline for a sparsity percentile; with a token budget (CTKVR's
Table 10: 512) the threshold is the one that keeps `budget` keys: each query head attends to its `budget`
clustered keys of highest S (whole clusters in order, the boundary cluster cut at its earliest keys), plus,
as in the release, the observation window and every generated token, which are never clustered (attended on
top of the budget, CTKVR's convention that rho' counts the retrieved keys). A budget at or above the clustered
keys is full attention.

Choices where the release is silent or cannot run here: its k-means runs on a GPU (cuML, k-means++
initialisation); kvbench's runs on the layer's device in PyTorch (one batched matrix product per iteration,
all KV heads at once), initialised with C distinct keys drawn from the sample's generator. The hierarchical
(two-level) lookup is not implemented (CTKVR's comparison does not say it used it). The release clusters each
query head's repeated keys; with identical keys per group this is one clustering per KV head here. The
offline fixed-context setting (clusters shared by every question about one document) is the prompt itself:
the clustering time is part of the record's compression time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvbench.core.checks import is_int
from kvbench.core.contract import Plan, Schedule, Selection
from kvbench.methods.base import SelectionMethod, register_method
from kvbench.methods.common.derived import FixedState
from kvbench.methods.common.pages import top_tokens


@dataclass(frozen=True)
class KeyClusters(FixedState):
    """Per KV head: centroids [H, C, D] (means of the raw keys), each clustered row's label [H, m] (rows 0..m-1 of
    the layer's storage: the prompt but its window) and the clusters' sizes [H, C]."""

    centroids: torch.Tensor
    labels: torch.Tensor
    sizes: torch.Tensor
    iterations: int

    @property
    def clustered(self) -> int:
        return self.labels.shape[1]

    def truncate(self, layer) -> "KeyClusters":  # new tokens are attended on top of the budget, never clustered
        if layer.seen < self.clustered:
            raise ValueError("Squeezed Attention cannot roll back into its clustered keys")
        return self

    @property
    def paper_elements(self) -> int:  # the centroids and each key's label: auxiliary storage
        return self.centroids.numel() + self.labels.numel()


# at most this many key-centroid similarities at once (512 MiB of float32): 128K keys of 8 KV heads against 5% as
# many centroids would otherwise be a 27 GB matrix per iteration
SIMILARITY_ELEMENTS = 1 << 27


def spherical_kmeans(keys: torch.Tensor, clusters: int, iterations: int,
                     generator: torch.Generator) -> tuple[torch.Tensor, int]:
    """Labels [H, n] of k-means by cosine similarity over `keys` [H, n, D] (each head on its own), initialised with
    `clusters` distinct rows per head drawn from `generator`; Lloyd iterations until no label changes or
    `iterations` ran (returned). An empty cluster keeps its previous centre."""
    heads, n, _ = keys.shape
    unit = F.normalize(keys.float(), dim=-1)
    first = torch.stack([torch.randperm(n, generator=generator)[:clusters] for _ in range(heads)]).to(keys.device)
    centres = unit.gather(1, first[..., None].expand(-1, -1, unit.shape[-1]))
    labels = None
    ran = 0
    rows = max(1, SIMILARITY_ELEMENTS // (heads * clusters))  # keys scored at once: a bounded similarity matrix
    for ran in range(1, iterations + 1):
        new = torch.cat([torch.einsum("hnd,hcd->hnc", unit[:, start:start + rows], centres).argmax(dim=-1)
                         for start in range(0, n, rows)], dim=1)
        if labels is not None and torch.equal(new, labels):
            break
        labels = new
        sums = torch.zeros_like(centres).scatter_add_(1, labels[..., None].expand(-1, -1, unit.shape[-1]), unit)
        counts = torch.zeros(heads, clusters, device=keys.device).scatter_add_(1, labels, torch.ones_like(unit[..., 0]))
        centres = torch.where(counts[..., None] > 0, F.normalize(sums, dim=-1), centres)
    return labels, ran


@register_method
@dataclass
class SqueezedAttention(SelectionMethod):
    name = "squeezed_attention"
    percent_clusters: float = 5.0  # C = percent_clusters% of the clustered keys (the release's PC5)
    window: int = 100  # the prompt's last tokens, never clustered, always attended (the release's obs window)
    kmeans_iterations: int = 300  # at most; stops once no label changes

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.percent_clusters, bool) or not 0 < self.percent_clusters <= 100:
            raise ValueError(f"percent_clusters must be a percentage in (0, 100], got {self.percent_clusters!r}")
        for name, low in (("window", 0), ("kmeans_iterations", 1)):
            value = getattr(self, name)
            if not is_int(value) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")

    def schedule(self) -> Schedule:
        # the one "eviction" event at the prompt's end clusters the keys (nothing is dropped)
        return Schedule(block_size=None, decode_every=0)

    def plan(self, budget, *, sequence_length, new_tokens, head_dim, num_layers=None):
        clustered = sequence_length - new_tokens - self.window
        if budget >= clustered:
            return Plan.full_attention()
        return Plan(evict=budget, select=budget, derived={
            "clustered": clustered, "centroids": max(1, int(self.percent_clusters / 100 * clustered)),
            "window": self.window})

    def keep(self, layer, budget, step):
        view = layer.head_view()
        if layer.is_ragged or view.keys.shape[1] != layer.seen:
            raise ValueError("Squeezed Attention clusters a layer that holds its whole prompt, uniformly")
        clustered = layer.seen - self.window
        if budget >= clustered:
            return None  # every clustered key fits the budget: full attention
        count = max(1, int(self.percent_clusters / 100 * clustered))
        keys = view.keys[:, :clustered]
        labels, iterations = spherical_kmeans(keys, count, self.kmeans_iterations, step.generator)
        dim = keys.shape[-1]
        sums = torch.zeros(keys.shape[0], count, dim, device=keys.device).scatter_add_(
            1, labels[..., None].expand(-1, -1, dim), keys.float())
        sizes = torch.zeros(keys.shape[0], count, device=keys.device).scatter_add_(
            1, labels, torch.ones_like(labels, dtype=torch.float32))
        centroids = (sums / sizes.clamp(min=1)[..., None]).to(keys.dtype)
        layer.derived["clusters"] = KeyClusters(centroids, labels, sizes, iterations)
        return None

    def select(self, layer, q, view, step, scaling):
        index = layer.derived.get("clusters")
        budget = step.plan.select
        if index is None or budget >= index.clustered:
            return None
        heads, group, _ = q.shape
        logits = torch.einsum("hgd,hcd->hgc", q.float(), index.centroids.float()) * scaling
        sizes = index.sizes[:, None, :]
        # S_k = exp(l_k) / sum_j n_j exp(l_j) = softmax(l + log n)_k / n_k; an empty cluster scores 0
        weighted = torch.softmax(logits + sizes.log(), dim=-1)
        estimate = torch.where(sizes > 0, weighted / sizes.clamp(min=1), torch.zeros_like(weighted))
        per_key = estimate.gather(2, index.labels[:, None, :].expand(-1, group, -1))  # [H, G, m]
        chosen = top_tokens(per_key.flatten(0, 1), budget).view(heads, group, budget)
        rest = torch.arange(index.clustered, view.keys.shape[1], device=q.device).expand(heads, group, -1)
        return Selection(torch.cat([chosen, rest], dim=-1),
                         extra={"clusters": float(index.centroids.shape[1]), "kmeans_iterations": float(index.iterations)})

    def step_traffic(self, layer, selection, step):
        """Every centroid once per KV group (the lookup), then the selected and window K/V."""
        traffic = super().step_traffic(layer, selection, step)
        if selection is None:
            return traffic
        return traffic + layer.derived["clusters"].centroids.numel()
