"""HSA: RocketKV's hybrid sparse attention (Behnam et al., "RocketKV: Accelerating Long-Context LLM Inference
via Two-Stage KV Cache Compression", ICML 2025, arXiv:2502.14051, §3.5), alone over the full cache (the paper's
ablation, App. B.1.1; `rocketkv` runs it after a SnapKV stage). Compared with the release (NVlabs/RocketKV,
`inf_llm/attention/rocket.py`) in docs/fidelity.md.

Every decode step, per KV group, with the layer's page summaries (element-wise key min/max of pages of `p`
stored tokens):

1. the `k1` head dimensions with the largest |q| summed over the group (ties to the lower dimension), and the
   group's sign of q on them;
2. each page's score bound from those dimensions (the page max where the sign is positive, the min where it
   is not; zero counts as negative, as the code), per query head;
3. the scores broadcast to the page's tokens, a softmax per query head with SparQ's temperature
   sqrt(D * sum_{k1}|q| / sum|q|), averaged over the group; the top `k2` tokens (ties to the lowest index);
4. exact attention of every query head over those `k2` tokens (no mean-value term).

Budget: `budget` is the per-step token budget t of one KV group, traffic of the estimate included. The
estimate reads P * k1 elements, the attention 2 * D * k2: with c2 = S / t, p = ceil(sqrt(c2)) (1 when
larger than c2), k1 = int(D * p / c2) and k2 = t // 2 the two halves are t/2 token-equivalents each.
A budget at or above S means full attention (the default short-circuit; RocketKV's code would still select
t/2 tokens there).

`scoring_dtype` (kvbench.methods.common.arithmetic): null/float32 scores in float32; `release` in float16, op by
op as the release (its model is hard-coded to float16): |q| averaged over the group, the bound, the temperature
sqrt(D * sum_{k1}|q| / sum|q|) (whose product can overflow float16 as the release's does), the softmax and its
group mean each rounded to float16; the exact attention stays kvbench's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvbench.core.contract import Plan, Selection
from kvbench.kernels.page_summary import page_scores
from kvbench.methods.base import SelectionMethod, register_method
from kvbench.methods.common.arithmetic import check_scoring_dtype, scoring_dtype
from kvbench.methods.common.dims import summed, top_dims, zero_past
from kvbench.methods.common.pages import OfLength, PageSummary, page_tokens, plan_pages, top_page_tokens


def hsa_parameters(compression: float, head_dim: int) -> dict[str, int]:
    """Page size p and estimate dimensions k1 for a stage-2 compression c2 (RocketKV `infllm_utils.compress`)."""
    c2 = max(1.0, compression)
    p = math.ceil(math.sqrt(c2))
    p = p if p <= c2 else 1
    return {"page_size": p, "k1": max(1, min(head_dim, int(head_dim * p / c2)))}


@dataclass(frozen=True)
class HSALength(OfLength):
    """HSA's page p and estimate dimensions k1 as functions of the length L its plan was made for, c2 = L / t
    (`hsa_parameters`): the static step takes both as runtime inputs (`kvbench.methods.common.pages.RuntimePage`),
    so that a sweep over prompt lengths does not compile a graph per length (10 over 12 lengths of 1K-8K while
    they were Python numbers). `dims` is the plan's k1, `k` its k2."""

    budget: int
    k: int
    head_dim: int
    dims: int

    def page(self, length: float) -> int:
        return hsa_parameters(length / self.budget, self.head_dim)["page_size"]

    def most_dims(self, lo: int, hi: int) -> int:
        """The largest k1 of a length in lo..hi. k1 = int(D p / c2) falls as c2 grows while p stays, so it peaks
        where p steps up: at lo, at c2 = 2 (p from 1 to 2) and just past each square p^2 (p to p + 1)."""
        steps = [2 * self.budget] + [p * p * self.budget + 1 for p in range(2, math.isqrt(hi // self.budget) + 2)]
        lengths = [lo] + [n for n in steps if lo < n <= hi]
        return max(hsa_parameters(n / self.budget, self.head_dim)["k1"] for n in lengths)


def hsa_select(q: torch.Tensor, pages: PageSummary, k1: int, k2: int, length: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The `[H, G, k]` token indices HSA attends to (k = min(k2, length)), shared by each group, the scores in
    `dtype` (float32, or float16: the release's arithmetic). On a static layer (`pages.fill`) the pages span the
    capacity and the tokens past each head's length get no score; where the page and k1 are runtime inputs
    (`pages.runtime`), so are the dimensions (`kvbench.methods.common.dims`)."""
    heads, group, dim = q.shape
    if dtype == torch.float32:
        absq = q.float().abs()
        chosen = top_dims(absq.sum(dim=1), k1, pages.runtime_dims)  # [H, k1]
        dims = chosen.dims
        positive = q.float().sum(dim=1).gather(-1, dims) > 0  # [H, k1]
        q_on = zero_past(q, chosen)  # the plan's dimensions (a runtime k1: the others zeroed)
        estimate = page_scores(q_on, pages.kmin, pages.kmax, dims, positive[:, None, :])  # [H, G, P]
    else:  # the release's float16 ops: the group's mean |q|, the sign of its sum, the bound's product rounded
        q, kmin, kmax = q.to(dtype), pages.kmin.to(dtype), pages.kmax.to(dtype)
        absq = q.abs()
        chosen = top_dims(absq.mean(dim=1), k1, pages.runtime_dims, stable=False)  # the release's topk
        dims = chosen.dims
        positive = q.sum(dim=1).gather(-1, dims) > 0
        estimate = page_scores(zero_past(q, chosen), kmin, kmax, dims, positive[:, None, :]).to(dtype)
    on_dims = summed(absq.gather(-1, dims[:, None, :].expand(heads, group, dims.shape[1])), chosen.past)
    temperature = torch.sqrt(dim * on_dims / absq.sum(-1))[..., None]  # [H, G, 1]
    if pages.fill is None:
        # the softmax over tokens (not pages weighted by their sizes) keeps the scores' exact float values
        tokens = page_tokens(estimate / temperature, pages.page_size, length)
        score = torch.softmax(tokens, dim=-1).mean(dim=1)
        idx = top_page_tokens(score[:, :: pages.page_size], pages.page_size, length, k2)
    else:  # a static layer: the compiled step, where the page-weighted softmax saves p-fold exponentials
        idx = pages.top_tokens(_page_softmax_mean(estimate / temperature, pages), pages.fill, k2)
    return idx[:, None, :].expand(heads, group, idx.shape[1])


def _page_softmax_mean(scores: torch.Tensor, pages: PageSummary) -> torch.Tensor:
    """The softmax over tokens of `scores` [H, G, P] broadcast to each page's tokens, averaged over the group,
    at each page's first token: [H, P], 0 for pages past a head's tokens. Every token of a page has its page's
    score, so each page's exponential is computed once and weighted by the tokens it holds: the function the
    eager path computes over tokens, equal up to the rounding of the normaliser (the compiled step's tokens
    are checked against the eager ones). On a bf16 HSA step at 8K (1,366 pages of 6 tokens) the token-level
    softmax was 100-200 us per layer on two CPU cores."""
    page = pages.static_page
    first_rows = torch.arange(scores.shape[-1], device=scores.device) * page
    counts = torch.minimum((pages.fill[:, None] - first_rows[None, :]).clamp(min=0), page)[:, None, :]  # [H, 1, P]
    held = counts > 0
    top = scores.masked_fill(~held, float("-inf")).amax(dim=-1, keepdim=True)
    weights = torch.exp(scores - top).masked_fill(~held, 0.0)
    return (weights / (weights * counts).sum(dim=-1, keepdim=True)).mean(dim=1)



@dataclass(frozen=True)
class HSAStage:
    """HSA as a decode stage any method can run (HSA alone, RocketKV's stage 2): pages built when the segment
    ends and kept current, `k2` tokens selected per step (scored in `dtype`), the estimate's traffic counted.
    The method's plan derives page_size, k1 and k2."""

    dtype: torch.dtype = torch.float32

    def build_derived(self, layer, step) -> dict:
        plan = step.plan
        if not plan.select:
            return {}
        d = plan.derived
        of_length = HSALength(plan.select, d["k2"], layer.head_dim, d["k1"])
        return {"pages": PageSummary.of(layer.head_view().keys, d["page_size"], of_length)}

    def select(self, layer, q, step) -> torch.Tensor | None:
        d = step.plan.derived
        length = layer.physical_length()
        if d["k2"] >= length:
            return None
        return hsa_select(q, plan_pages(layer, step.plan), d["k1"], d["k2"], length, self.dtype)

    def traffic(self, layer, selection: Selection, step) -> int:
        """Elements read: one bound per chosen dimension of every page, plus K and V of the selected tokens."""
        pages = plan_pages(layer, step.plan)
        heads = selection.idx.shape[0]
        k1 = pages.estimate_dims(step.plan.derived["k1"])
        return heads * (pages.pages * k1 + 2 * layer.head_dim * selection.idx.shape[-1])


@register_method
@dataclass
class HSA(SelectionMethod):
    name = "hsa"
    static_selection = True
    scoring_dtype: str | None = None  # null/float32 | release: the estimate in float16, as the release

    def __post_init__(self) -> None:
        super().__post_init__()
        check_scoring_dtype(self.scoring_dtype)

    @property
    def stage(self) -> HSAStage:
        return HSAStage(scoring_dtype(self.scoring_dtype, torch.float16))

    def plan(self, budget, *, sequence_length, new_tokens, head_dim, num_layers=None):
        if budget >= sequence_length:
            return Plan.full_attention()
        return Plan(evict=None, select=budget, derived={"c2": sequence_length / budget, "k2": budget // 2,
                                                        **hsa_parameters(sequence_length / budget, head_dim)})

    def build_derived(self, layer, step):
        return self.stage.build_derived(layer, step)

    def select(self, layer, q, view, step, scaling):
        return self.stage.select(layer, q, step)

    def step_traffic(self, layer, selection, step):
        return super().step_traffic(layer, None, step) if selection is None else self.stage.traffic(layer, selection, step)
