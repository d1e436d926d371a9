"""H2O (Zhang et al. 2023): keep the heavy hitters, the tokens with the most accumulated attention.

Every query the layer attends with (each prompt token, each prefill block, each decode step) adds its
attention row (softmax over the entries stored at that moment, fp32) to a per-token accumulator, averaged
over the query heads of the KV group (KeyDiff App. F.2) and summed over queries, as the original code's
column sums. The accumulator is token state in the cache (`layer.token_tensor("h2o")`): eviction gathers it
with the keys, so a kept token keeps its history and a new one starts at zero.

`recent_ratio` reserves that share of the budget for the most recent tokens. The KeyDiff paper's baseline
(KeyDiff §4, App. F.2) is pure accumulated attention, the default 0; the original H2O splits the budget
half and half between heavy hitters and recent tokens (its scripts use heavy_ratio = recent_ratio = 0.1 of
the prompt): `recent_ratio=0.5`. Under block-wise prefill fresh tokens have been seen by fewer queries and
are evicted first, which is why H2O does so badly in KeyDiff's block setting.

Against the release (FMInference/H2O, MHA only) on the same tensors, and what the GQA group mean changes:
docs/fidelity.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench.methods.base import ScoredEviction, register_method

QUERY_CHUNK = 256  # query rows per attention recomputation: bounds the [H, G, rows, L] scratch tensor


@register_method
@dataclass
class H2O(ScoredEviction):
    name = "h2o"
    observes = True
    recent_ratio: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.recent_ratio <= 1:
            raise ValueError(f"recent_ratio must be in [0, 1], got {self.recent_ratio!r}")

    def observe_step(self, layer, queries, step):
        """A decode step on the static layout: its query attends to every stored token; added in place."""
        view = layer.head_view()
        q = queries.float().view(view.keys.shape[0], -1, view.keys.shape[-1])  # [H, G, D]
        logits = torch.einsum("hgd,hld->hgl", q, view.keys.float()) * layer.scaling
        probs = torch.softmax(logits.masked_fill(~view.valid[:, None, :], float("-inf")), dim=-1).mean(dim=1)
        layer.static_add_token_state("h2o", probs)

    def observe(self, layer, queries, step):
        view = layer.head_view()
        heads, width = view.positions.shape
        group = queries.shape[0] // heads
        n = queries.shape[1]
        q = queries.float().view(heads, group, n, -1)
        q_pos = torch.arange(layer.seen - n, layer.seen, device=queries.device)
        hidden = view.positions[:, None, None, :] < 0  # ragged padding
        keys = view.keys.float()
        total = torch.zeros(heads, width, device=queries.device)
        for start in range(0, n, QUERY_CHUNK):
            rows = slice(start, start + QUERY_CHUNK)
            logits = torch.einsum("hgqd,hld->hgql", q[:, :, rows], keys) * layer.scaling
            future = view.positions[:, None, None, :] > q_pos[rows][None, None, :, None]
            logits.masked_fill_(future | hidden, float("-inf"))
            total += torch.softmax(logits, dim=-1).mean(dim=1).sum(dim=1)
        delta = total if view.valid is None else total[view.valid]
        layer.token_state["h2o"] = layer.token_tensor("h2o") + delta  # a new tensor: clones share the old one

    def score(self, layer, step):
        return layer.token_state["h2o"]

    def recent_tokens(self, budget):
        return round(self.recent_ratio * budget)
