"""Exact-TopK: the oracle of dynamic sparse attention (RocketKV's upper bound).

At every decode step each query head computes exact q.K^T over the whole cache and attends only to its top
`budget` keys, with the softmax over those keys alone; the cost of finding them is not counted. Following
RocketKV's `topk.py`, selection is per query head (`granularity=head`), so a GQA group may touch up to
G*budget distinct tokens; `granularity=group` shares one selection per KV group, ranked by the sum of the
group's softmax probabilities; `granularity=group_max` ranks by their max, which is CTKVR's FLAT baseline (an
exact linear scan attending to the top-1024 keys, specs/ctkvr.md §4: "the same max-over-group aggregation" as
CTKVR's rerank; `kvbench/conf/method/exact_topk_flat.yaml`). Nothing is evicted; with budget >= cache length it is
exactly full attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench.methods.base import Method, register_method


@register_method
@dataclass
class ExactTopK(Method):
    name = "exact_topk"
    family = "selection"
    selects = True
    static_selection = True
    granularity: str = "head"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.granularity not in ("head", "group", "group_max"):
            raise ValueError(f"granularity must be head, group or group_max, not {self.granularity!r}")

    def select(self, layer, q, view, step, scaling):
        budget = step.plan.select
        if budget >= view.keys.shape[1]:
            return None  # every token is in the top k: exactly full attention
        logits = torch.einsum("hgd,hld->hgl", q.float(), view.keys.float()) * scaling
        if view.valid is not None:
            logits.masked_fill_(~view.valid[:, None, :], float("-inf"))
        if self.granularity == "head":
            return logits.topk(budget, dim=-1).indices
        probs = torch.softmax(logits, dim=-1)
        shared = (probs.sum(dim=1) if self.granularity == "group" else probs.amax(dim=1)).topk(budget, dim=-1).indices
        return shared[:, None, :].expand(-1, q.shape[1], -1)
