"""Exact-TopK: the oracle of dynamic sparse attention (RocketKV's upper bound).

At every decode step each query head computes exact q.K^T over the whole cache and attends only to its top
`budget` keys, with the softmax over those keys alone; the cost of finding them is not counted. Following
RocketKV's `topk.py`, selection is per query head (`granularity=head`), so a GQA group may touch up to
G*budget distinct tokens; `granularity=group` shares one selection per KV group, ranked by the sum of the
group's softmax probabilities; `granularity=group_max` ranks by their max, which is CTKVR's FLAT baseline (an
exact linear scan attending to the top-1024 keys, CTKVR §4.1.2, which does not say how it aggregates a GQA
group: kvbench takes the max over the group, as CTKVR's rerank does; `kvbench/conf/method/exact_topk_flat.yaml`). Nothing is evicted; with budget >= cache length it is
exactly full attention.

Its cost model counts what it attends (RocketKV's oracle), not the keys it reads to rank them
(`scores_every_key`: `scripts/bench_decode_latency.py` adds them to the bytes its eager reference step reads).
In the compiled decode step the logits are summed in another order (`kernels.exact_scores`) and per-query-head
ties go to the lower index (`top_tokens`); its tokens are checked against the eager step's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench.kernels.exact_scores import exact_logits
from kvbench.methods.base import SelectionMethod, register_method
from kvbench.methods.common.pages import top_tokens


@register_method
@dataclass
class ExactTopK(SelectionMethod):
    name = "exact_topk"
    static_selection = True
    scores_every_key = True
    granularity: str = "head"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.granularity not in ("head", "group", "group_max"):
            raise ValueError(f"granularity must be head, group or group_max, not {self.granularity!r}")

    def select(self, layer, q, view, step, scaling):
        budget = step.plan.select
        if budget >= view.keys.shape[1]:
            return None  # every token is in the top k: exactly full attention
        logits = exact_logits(q, view.keys) * scaling
        if view.valid is not None:
            logits.masked_fill_(~view.valid[:, None, :], float("-inf"))
        if self.granularity == "head":
            if torch.compiler.is_compiling():  # ties to the lower index; an int64 topk mispredicts fewer branches
                return top_tokens(logits.flatten(0, 1), budget).view(*logits.shape[:2], budget)
            return logits.topk(budget, dim=-1).indices
        probs = torch.softmax(logits, dim=-1)
        shared = (probs.sum(dim=1) if self.granularity == "group" else probs.amax(dim=1)).topk(budget, dim=-1).indices
        return shared[:, None, :].expand(-1, q.shape[1], -1)
