"""Ada-KV (Feng et al., "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for Efficient LLM
Inference", NeurIPS 2025, arXiv:2407.11550): head-wise adaptive budget allocation, here on SnapKV (Ada-SnapKV).
Compared with the release (FFY0/AdaKV, `AdaptiveSnapKVCluster.update_kv_gqa`) in docs/fidelity.md.

Per layer, with b = budget - window outside-window slots per KV head and h KV heads:

1. SnapKV's pooled window scores `a` ([h, n], n = L - window; GQA group mean, max-pool kernel 7).
2. Algorithm 1: the global top-(h*b) entries of `a` over all heads of the layer; head i wins f_i of them.
3. Safeguard: B_i = (1 - alpha) * f_i + alpha * b, so each head keeps at least alpha*b slots. This is the
   authors' code's weighting; the paper's Algorithm 2 prints the opposite one, which is `alpha=0.8` here.
   `rounding` null: the real-valued B_i are rounded by largest remainder so that sum(B_i) = h*b exactly;
   `release`: as the code, B_i = round((1 - alpha) * f_i + int(alpha * b)), whose floor int(alpha * b) and
   per-head rounding leave the layer's total a few tokens off h*b (mostly short: -1 to 4 at 8 heads).
4. Head i keeps its own top-B_i tokens plus the window. Heads then hold different numbers of tokens and the
   cache stores them ragged (flattened per layer), so the memory is really freed.

`alpha=0` gives plain Algorithm 1 (the retained attention mass is then the global optimum, Thm 3.3).

`scoring_dtype` (kvbench.methods.common.arithmetic): null/float32 computes the window scores in float32 (kvbench's
choice: the same selection in every model dtype); `release` as the release's `calcul_attn_sore` does, in the
model's dtype (bfloat16 in its runs): the logits and their scaling, the softmax (float32, rounded back to the
model's dtype), the window mean, the group mean and the pooling. Its selection then depends on the dtype, and
bfloat16 scores tie often (the order of tied scores is the backend's).

`allocation=kvpress` is NVIDIA kvpress's `AdaKVPress` rule instead, to reproduce its published numbers: each
head's top int(alpha * budget) tokens by score (the window, scored above everything, included) are
protected, then the layer keeps its global top H * budget scores. Its floor is weaker than the authors'
(alpha of the whole budget, window included, rather than alpha of the budget outside the window on top of
the window), and the adaptive part is chosen after the protected tokens.

Block-wise or decode-time eviction (`block_size`, `decode_every`, not in the paper) re-runs the allocation on
the ragged layer: the layer's total stays H * budget, each head's window is its own last `window` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench.methods.base import EvictionMethod, register_method
from kvbench.methods.common.arithmetic import check_scoring_dtype
from kvbench.methods.snapkv import SnapKV, pool_scores, with_window


def allocate(scores: torch.Tensor, total: int, alpha: float, capacity: list[int] | None = None,
             rounding: str | None = None) -> list[int]:
    """Per-head budgets for `total` slots over `scores` [h, n] (Algorithm 1 plus the alpha safeguard).

    `rounding` null: the real-valued budgets by largest remainder, summing to `total`; `release`: the release's
    round((1 - alpha) * f_i + int(alpha * total / h)) in float32 (half to even), whose sum may miss `total`.
    `capacity` caps each head at its number of candidates when heads hold different numbers of tokens
    (re-eviction of a ragged layer after a block or a decode step; -inf scores mark the missing ones): a
    capped head's excess goes to the heads that won the most slots among those with room, so the sum stays
    `total`. After a single dense prefill no cap ever binds.
    """
    heads, n = scores.shape
    won = torch.bincount(scores.reshape(-1).topk(total).indices // n, minlength=heads).double()
    if rounding == "release":
        floor = int(total // heads * alpha)
        return [int(b) for b in torch.round(won.float() * (1 - alpha) + floor)]
    target = (1 - alpha) * won + alpha * (total / heads)
    budgets = target.floor()
    short = total - int(budgets.sum())
    if short:
        # largest remainder; ties go to the lower head index (stable sort) for determinism
        order = torch.sort(target - budgets, descending=True, stable=True).indices[:short]
        budgets[order] += 1
    result = [int(b) for b in budgets]
    if capacity is not None:
        excess = sum(max(0, b - c) for b, c in zip(result, capacity))
        result = [min(b, c) for b, c in zip(result, capacity)]
        for h in torch.sort(won, descending=True, stable=True).indices.tolist():
            extra = min(excess, capacity[h] - result[h])
            result[h] += extra
            excess -= extra
    return result


def with_window_scores(scores: torch.Tensor, lens: list[int], window: int) -> torch.Tensor:
    """Candidate scores [h, n] extended to every stored token [h, max len]: each head's window +inf."""
    out = torch.full((len(lens), max(lens)), float("-inf"), device=scores.device)
    for h, n in enumerate(lens):
        out[h, : n - window] = scores[h, : n - window]
        out[h, n - window: n] = float("inf")
    return out


def allocate_kvpress(scores: torch.Tensor, budget: int, alpha: float) -> list[torch.Tensor]:
    """kvpress's AdaKVPress: per head, the sorted indices it keeps out of `scores` [h, L] (the window scored
    +inf, missing entries of a ragged layer -inf): protect each head's top int(alpha * budget), then keep the
    layer's global top h * budget."""
    heads, length = scores.shape
    protected = scores.topk(min(int(alpha * budget), length), dim=-1).indices
    scores = scores.scatter(-1, protected, float("inf"))
    kept = scores.reshape(-1).topk(heads * budget).indices.sort().values
    return [kept[kept // length == h] % length for h in range(heads)]  # sorted flat rows: sorted per head


@register_method
@dataclass
class AdaKV(EvictionMethod):
    """Ada-KV's allocation around SnapKV's scores (`scorer`). The fields stay flat (the YAML's); `window`,
    `kernel`, `pooling`, `gqa_agg` and `granularity` are the scorer's and are checked there."""

    name = "adakv"
    ragged_layers = True
    window: int = 32
    kernel: int = 7
    pooling: str = "max"
    gqa_agg: str = "mean"
    granularity: str | None = None
    alpha: float = 0.2
    allocation: str | None = None  # authors (null): (1 - alpha) f_i + alpha b, the Ada-KV code; kvpress: AdaKVPress
    rounding: str | None = None  # null: largest remainder, the layer's total exact; release: the code's int()/round()
    scoring_dtype: str | None = None  # null/float32 | release: the window scores in the model's dtype (module doc)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.scorer = SnapKV(window=self.window, kernel=self.kernel, pooling=self.pooling, gqa_agg=self.gqa_agg,
                             granularity=self.granularity)
        self.granularity = self.scorer.granularity
        if self.granularity != "group":
            raise ValueError("adakv allocates per KV head: granularity must be group")
        self.allocation = self.allocation or "authors"
        if self.allocation not in ("authors", "kvpress"):
            raise ValueError(f"allocation must be authors or kvpress, not {self.allocation!r}")
        if self.rounding not in (None, "release"):
            raise ValueError(f"rounding must be release or null (largest remainder), not {self.rounding!r}")
        check_scoring_dtype(self.scoring_dtype)
        if self.scoring_dtype == "release" and (self.block_size is not None or self.decode_every):
            raise ValueError("scoring_dtype=release is the release's one eviction at the end of the prefill: "
                             "block_size and decode_every must be null with it")
        if not 0 <= self.alpha <= 1:
            raise ValueError(f"alpha (the per-head floor, a fraction of the uniform budget) must be in [0, 1], "
                             f"got {self.alpha!r}")

    @property
    def obs_window(self) -> int:
        return self.window

    def keep(self, layer, budget, step):
        lens = layer.lengths()
        if budget * len(lens) >= sum(lens):
            return None
        window = min(self.window, budget)
        if window == budget:
            return [torch.arange(n - window, n, device=layer.keys.device) for n in lens]
        if self.scoring_dtype == "release" and not layer.is_ragged:
            queries, _ = layer.recent_queries(window)
            scores = pool_scores(release_window_scores(queries, layer.head_view().keys, layer.scaling, self.gqa_agg),
                                 self.pooling, self.kernel)
        else:
            scores = self.scorer.pooled_scores(layer, window)
        if self.allocation == "kvpress":
            return allocate_kvpress(with_window_scores(scores, lens, window), budget, self.alpha)
        capacity = [n - window for n in lens] if layer.is_ragged else None
        per_head = allocate(scores, (budget - window) * scores.shape[0], self.alpha, capacity, self.rounding)
        return [with_window(s.topk(b).indices, n, window) for s, b, n in zip(scores, per_head, lens)]


def release_window_scores(queries: torch.Tensor, keys: torch.Tensor, scaling: float, gqa_agg: str) -> torch.Tensor:
    """The window scores in the release's arithmetic (`AdaptiveSnapKVCluster.calcul_attn_sore`), in the keys'
    dtype (the model's): the window's logits over every key divided by sqrt(D), the window's causal mask added,
    the softmax in float32 rounded back, the mean over the window queries and over each group. `queries`
    [H_q, w, D] are the layer's last w, `keys` [H, L, D] a dense layer's; returns [H, L - w]."""
    n_q, w, dim = queries.shape
    n_kv, length, _ = keys.shape
    dtype = keys.dtype
    logits = torch.einsum("hqd,hld->hql", queries.to(dtype).reshape(n_kv, n_q // n_kv * w, dim), keys)
    logits = (logits / (1 / scaling)).view(n_kv, n_q // n_kv, w, length)
    future = torch.ones(w, w, dtype=torch.bool, device=keys.device).triu(1)
    logits[..., length - w:] = logits[..., length - w:].masked_fill(future, torch.finfo(dtype).min)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32).to(dtype)[..., : length - w].mean(dim=2)
    return probs.amax(dim=1) if gqa_agg == "max" else probs.mean(dim=1)
