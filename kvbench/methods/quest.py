"""Quest (Tang et al. 2024): query-aware page selection from per-page key bounds (RocketKV's baseline, spec §4).

Pages of `page_size` stored tokens keep the element-wise min and max of their keys. At each decode step each
query head bounds every page's logit by sum_d max(q_d * max_d, q_d * min_d) (>= q.k for every key of the
page); the bounds are summed over the query heads of each KV group, broadcast to the page's tokens, and the
group attends exactly to the top `k2` tokens (whole pages, the boundary page cut at its first tokens).

Budget (per KV group and step, estimate included, as RocketKV evaluates it): fetching a page's min and max
costs one token-equivalent, so with page_size = max(1, round(2 S / t)) the S / page_size page bounds cost t/2
and the exact attention k2 = t/2 tokens. That page size is kvbench's inference from RocketKV's equal-traffic
rule (RocketKV does not state its Quest pages, specs/rocketkv.md §8.8), not Quest's own: at S = 96K and
t = 256 it is about 750 tokens, with 128 tokens attended, where Quest's release uses pages of 16 tokens.
`page_size` fixes the page instead. A budget at or above S is full attention.

`budget_unit=attended` is Quest's own accounting, which CTKVR's baselines use (CTKVR §4.1.2: "a sparsity
budget of 1,024 tokens", Quest with its page of 16): the group attends to `budget` tokens and the page bounds
are read on top (the records' read tokens say how many). `kvbench/conf/method/quest_page16.yaml` is Quest as its
release runs it: page 16, `budget_unit=attended`, the first two layers dense (mit-han-lab/Quest,
`evaluation/quest_attention.py`: `if q_len > 1 or self.layer_id < 2: return self.flash_forward(...)`).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbench.core.contract import Plan
from kvbench.kernels.page_summary import page_scores
from kvbench.methods.base import Method, register_method
from kvbench.methods.common.pages import PageSummary, layer_pages, top_page_tokens


@register_method
@dataclass
class Quest(Method):
    name = "quest"
    family = "selection"
    selects = True
    static_selection = True
    page_size: int | None = None  # null: the traffic-equivalent page max(1, round(2 S / t))
    budget_unit: str | None = None  # null/traffic: RocketKV's, bounds count as half; attended: Quest's, CTKVR's

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.page_size is not None and self.page_size < 1:
            raise ValueError(f"page_size must be a positive number of tokens or null, got {self.page_size!r}")
        if self.budget_unit not in (None, "traffic", "attended"):
            raise ValueError(f"budget_unit must be traffic, attended or null, not {self.budget_unit!r}")

    def plan(self, budget, *, sequence_length, new_tokens, head_dim, num_layers=None):
        if budget >= sequence_length:
            return Plan.full_attention()
        page = self.page_size or max(1, round(2 * sequence_length / budget))
        attended = budget if self.budget_unit == "attended" else budget // 2
        return Plan(evict=None, select=budget, derived={"page_size": page, "k2": attended})

    def build_derived(self, layer, step):
        plan = step.plan
        return {"pages": PageSummary.of(layer.head_view().keys, plan.derived["page_size"])} if plan.select else {}

    def select(self, layer, q, view, step, scaling):
        page, k2 = step.plan.derived["page_size"], step.plan.derived["k2"]
        if k2 >= view.width:
            return None
        pages = layer_pages(layer, page)
        heads, group, _ = q.shape
        bound = page_scores(q, pages.kmin, pages.kmax, None, q > 0).sum(dim=1)  # [H, P], summed over the group
        unused = pages.unused_pages()  # a static layer's pages past its tokens
        if unused is not None:
            bound = bound.masked_fill(unused, float("-inf"))
        idx = top_page_tokens(bound, page, view.lengths if view.lengths is not None else view.width, k2)
        return idx[:, None, :].expand(heads, group, idx.shape[1])

    def step_traffic(self, layer, selection, step):
        if selection is None:
            return super().step_traffic(layer, None, step)
        pages = layer_pages(layer, step.plan.derived["page_size"])
        return selection.idx.shape[0] * 2 * layer.head_dim * (pages.pages + selection.idx.shape[-1])
