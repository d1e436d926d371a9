"""Quest (Tang et al., "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference", ICML 2024,
arXiv:2406.10774): query-aware page selection from per-page key bounds. Compared with the release
(mit-han-lab/Quest, `evaluation/quest_attention.py`) in docs/fidelity.md.

Pages of `page_size` stored tokens keep the element-wise min and max of their keys. At each decode step each
query head bounds every page's logit by sum_d max(q_d * max_d, q_d * min_d) (>= q.k for every key of the
page). What is selected from the bounds:

- `granularity`: null/`group` (RocketKV's Quest baseline, its App. A.1: "select indices of top-k accumulated
  attention scores per attention group"): the bounds are summed over the query heads of each KV group and the
  group shares one token set. `head` (Quest's release): the release repeats K/V to every query head and
  selects per query head, so each query head attends to its own pages, read for it alone.
- `budget_fill`: null/`tokens`: exactly k2 tokens, the top pages' tokens, the boundary page cut at its first
  tokens. `pages` (Quest's release, `local_heavy_hitter_mask`): the top min(max(3, k2 // page_size), pages)
  whole pages, the partial last page counting as one; a head then attends to fewer tokens when that page is
  among its pages (its rows are attended beside the stored selection and merged by log-sum-exp).

Budget (per KV group and step, estimate included, as RocketKV evaluates it): fetching a page's min and max
costs one token-equivalent, so with page_size = max(1, round(2 S / t)) the S / page_size page bounds cost t/2
and the exact attention k2 = t/2 tokens. That page size is kvbench's inference from RocketKV's equal-traffic
rule (RocketKV's §4 and App. A.1 do not state its Quest pages), not Quest's own: at S = 96K and t = 256 it is
about 750 tokens, with 128 tokens attended, where Quest's release uses pages of 16 tokens. `page_size` fixes
the page instead. A budget at or above S is full attention.

`budget_unit=attended` is Quest's own accounting, which CTKVR's baselines use (CTKVR §4.1.2: "a sparsity
budget of 1,024 tokens", the size of the KV retrieved): k2 = `budget` and the page bounds are read on top (the
records' read tokens say how many). `kvbench/conf/method/quest_page16.yaml` is Quest as its release runs it:
page 16, `budget_unit=attended`, `granularity=head`, `budget_fill=pages`, the first two layers dense (the
release: `if q_len > 1 or self.layer_id < 2: return self.flash_forward(...)`); `quest_ctkvr.yaml` is CTKVR's
baseline (the same pages and dense layers, exactly `budget` tokens per KV group).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench.core.contract import Plan, Selection
from kvbench.kernels.page_summary import page_scores
from kvbench.kernels.stable_topk import stable_topk
from kvbench.methods.base import SelectionMethod, register_method
from kvbench.methods.common.pages import OfLength, PageSummary, plan_pages


@dataclass(frozen=True)
class QuestPage(OfLength):
    """The traffic-equivalent page max(1, round(2 L / t)) of a budget t, and the k tokens selected (`OfLength`)."""

    budget: int
    k: int

    def page(self, length: float) -> int:
        return max(1, round(2 * length / self.budget))


@register_method
@dataclass
class Quest(SelectionMethod):
    name = "quest"
    static_selection = True
    page_size: int | None = None  # null: the traffic-equivalent page max(1, round(2 S / t))
    budget_unit: str | None = None  # null/traffic: RocketKV's, bounds count as half; attended: Quest's, CTKVR's
    granularity: str | None = None  # null/group: one token set per KV group (RocketKV's); head: per query head
    budget_fill: str | None = None  # null/tokens: exactly k2 tokens; pages: the release's whole pages

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.page_size is not None and self.page_size < 1:
            raise ValueError(f"page_size must be a positive number of tokens or null, got {self.page_size!r}")
        if self.budget_unit not in (None, "traffic", "attended"):
            raise ValueError(f"budget_unit must be traffic, attended or null, not {self.budget_unit!r}")
        if self.granularity not in (None, "group", "head"):
            raise ValueError(f"granularity must be group, head or null (group), not {self.granularity!r}")
        if self.budget_fill not in (None, "tokens", "pages"):
            raise ValueError(f"budget_fill must be tokens, pages or null (tokens), not {self.budget_fill!r}")

    @property
    def per_query_head(self) -> bool:
        return self.granularity == "head"

    @property
    def whole_pages(self) -> bool:
        return self.budget_fill == "pages"

    def static_decode_blocker(self) -> str | None:
        if self.per_query_head or self.whole_pages:
            return ("Quest's per-query-head selection (granularity=head) and whole-page fill (budget_fill=pages) "
                    "are written for the eager path: each query head may attend to a different number of tokens")
        return super().static_decode_blocker()

    def plan(self, budget, *, sequence_length, new_tokens, head_dim, num_layers=None):
        if budget >= sequence_length:
            return Plan.full_attention()
        attended = budget if self.budget_unit == "attended" else budget // 2
        page = self.page_size or QuestPage(budget, attended).page(sequence_length)
        return Plan(evict=None, select=budget, derived={"page_size": page, "k2": attended})

    def build_derived(self, layer, step):
        plan = step.plan
        if not plan.select:
            return {}
        # the traffic-equivalent page is a function of the prompt length: a runtime input of the compiled step
        of_length = QuestPage(plan.select, plan.derived["k2"]) if self.page_size is None else None
        return {"pages": PageSummary.of(layer.head_view().keys, plan.derived["page_size"], of_length)}

    def select(self, layer, q, view, step, scaling):
        k2 = step.plan.derived["k2"]
        if k2 >= view.width:
            return None
        pages = plan_pages(layer, step.plan)
        heads, group, _ = q.shape
        bound = page_scores(q, pages.kmin, pages.kmax, None, q > 0)  # [H, G, P]
        # one row per query head (h * G + g), or the group's bounds summed
        bound = bound.flatten(0, 1) if self.per_query_head else bound.sum(dim=1)
        if self.whole_pages:
            return self._whole_pages(q, view, bound, pages.page_size, k2, scaling, step.measure_recall)
        unused = pages.unused_pages()  # a static layer's pages past its tokens
        if unused is not None:
            bound = bound.masked_fill(unused, float("-inf"))
        idx = pages.top_tokens(bound, view.lengths if view.lengths is not None else view.width, k2)
        if self.per_query_head:
            return idx.view(heads, group, -1)
        return idx[:, None, :].expand(heads, group, idx.shape[1])

    def _whole_pages(self, q, view, bound, page, k2, scaling, measure_recall) -> Selection | None:
        """The release's fill (eager layers): each row's top min(max(3, k2 // page), P) pages, whole. When a row
        chose the layer's partial last page, rows attend to different numbers of tokens: every selected page but
        the last in page order is whole and read from the storage, and each row's last page is attended beside
        them (masked past the tokens), the two merged by log-sum-exp."""
        heads, group, _ = q.shape
        length, n_pages = view.width, bound.shape[-1]
        count = min(max(3, k2 // page), n_pages)
        if count >= n_pages:
            return None  # every page: full attention
        chosen = stable_topk(bound, count).sort(dim=-1).values  # [rows, count] pages in page order
        offsets = torch.arange(page, device=q.device)
        if length % page == 0 or not bool((chosen[:, -1] == n_pages - 1).any()):  # whole pages only
            idx = (chosen[:, :, None] * page + offsets).flatten(1)
            return idx.view(heads, group, -1) if self.per_query_head else idx[:, None].expand(heads, group, -1)
        stored = (chosen[:, :-1, None] * page + offsets).flatten(1)  # whole pages: [rows, (count - 1) * page]
        stored = stored.view(heads, group, -1) if self.per_query_head else stored[:, None].expand(heads, group, -1)
        last = (chosen[:, -1:] * page + offsets).view(heads, -1)  # [H, blocks * page]: the group's last pages
        held = last < length
        if self.per_query_head:  # G blocks per KV head, query head g attends to block g only
            block = torch.arange(group, device=q.device).repeat_interleave(page)
            own = block[None, :] == torch.arange(group, device=q.device)[:, None]  # [G, G * page]
        else:  # one block, the group's
            own = torch.ones(group, page, dtype=torch.bool, device=q.device)
        log_weights = torch.where(own[None] & held[:, None, :], 0.0, float("-inf"))  # [H, G, blocks * page]
        rows = last.clamp(max=length - 1)
        gather = rows[..., None].expand(-1, -1, view.keys.shape[-1])
        external = (view.keys.gather(1, gather), view.values.gather(1, gather), held, log_weights)
        recall = _recall(q, view.keys, stored, last, own[None] & held[:, None, :], scaling) if measure_recall else None
        return Selection(stored, external=external, recall=recall)

    def step_traffic(self, layer, selection, step):
        if selection is None:
            return super().step_traffic(layer, None, step)
        pages = plan_pages(layer, step.plan)
        heads, group, width = selection.idx.shape
        if selection.external is not None:  # whole pages: rows attended per query head, the last page's held rows
            attended = group * heads * width + int(torch.isfinite(selection.external[3]).sum())
        else:
            attended = group * heads * width
        # the page bounds are read once per KV head; K/V once per KV group, or for every query head (release)
        reads = attended if self.per_query_head else attended // group
        return 2 * layer.head_dim * (heads * pages.pages + reads)


def _recall(q, keys, stored, last, last_own, scaling) -> float:
    """Top-k attention-mass recall of a whole-page step: the exact mass on each query head's rows (`stored`
    [H, G, m] plus its own held rows of `last` [H, n] per `last_own` [H, G, n]) over the mass of its exact top as
    many tokens, averaged over query heads."""
    probs = torch.softmax(torch.einsum("hgd,hnd->hgn", q.float(), keys.float()) * scaling, dim=-1)
    mass = probs.gather(-1, stored).sum(-1) + (probs.gather(-1, last.clamp(max=keys.shape[1] - 1)[:, None, :]
                                                            .expand(-1, q.shape[1], -1)) * last_own).sum(-1)
    counts = stored.shape[-1] + last_own.sum(-1)  # [H, G]
    best = probs.sort(dim=-1, descending=True).values.cumsum(dim=-1).gather(-1, (counts - 1)[..., None])[..., 0]
    return float((mass / best).mean())
