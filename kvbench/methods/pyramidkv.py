"""PyramidKV (Cai et al. 2024; Zhang et al. 2024a in Ada-KV's citations): SnapKV with budgets that shrink
with depth.

The schedule is the PyramidKV code's (as Ada-KV's Ada-Pyramid uses it, Ada-KV §3.4; beta 20): with b = budget - window outside-window
slots per head on average and n = tokens seen - window candidates,

    min_num = b // beta;  max_num = 2b - min_num
    if max_num >= n: max_num = n; min_num = 2b - max_num
    steps = (max_num - min_num) // (num_layers - 1);  b_l = max_num - l * steps   (layer l = 0 the shallowest)

and each layer keeps its top-b_l tokens by SnapKV's scores plus the window. `layer_schedule=authors` (the default)
is exactly that code, the one behind PyramidKV's and Ada-KV's tables (Ada-KV's Ada-Pyramid uses the same
floored step): flooring the step makes the layers keep more than the uniform total (+5 % at budget 128 on 30
layers, +1.3 % at 1024 on 32); records hold the true per-layer counts. `layer_schedule=exact` spreads the real-valued
b_l by largest remainder instead, so the layers' sum is exactly num_layers * b and the schedule still never
increases with depth: equal memory against SnapKV, which the papers' comparison does not have. As in Ada-KV's
release (its `pyram_mode`), a prompt shorter than 2b still gets the clipped schedule; PyramidKV's own code falls
back to SnapKV's uniform b there. Block-wise or decode-time eviction recomputes the schedule from the tokens
seen so far.

Against KVCache-Factory's `PyramidKVCluster` on the same tensors, with the short-prompt departure measured:
docs/fidelity.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbench.methods.base import register_method
from kvbench.methods.snapkv import SnapKV

SCHEDULES = ("authors", "exact")


def pyramid_budgets(num_layers: int, b: int, candidates: int, beta: int = 20, schedule: str = "authors") -> list[int]:
    """Outside-window slots per head for each layer, non-increasing with depth: the PyramidKV code's floored
    step (`authors`), or summing to exactly num_layers * b (`exact`)."""
    if num_layers == 1 or b >= candidates:
        return [b] * num_layers
    min_num = b // beta
    max_num = 2 * b - min_num
    if max_num >= candidates:
        max_num = candidates
        min_num = 2 * b - max_num
    if schedule == "authors":
        steps = (max_num - min_num) // (num_layers - 1)
        return [max_num - layer * steps for layer in range(num_layers)]
    real = [max_num - layer * (max_num - min_num) / (num_layers - 1) for layer in range(num_layers)]
    budgets = [int(x) for x in real]  # every real value is >= 0, so int() floors
    short = num_layers * b - sum(budgets)
    # largest remainder, ties to the shallower layer: the rounded schedule stays non-increasing
    by_remainder = sorted(range(num_layers), key=lambda layer: (-(real[layer] - budgets[layer]), layer))
    for layer in by_remainder[:short]:
        budgets[layer] += 1
    return budgets


def check_beta(beta: int) -> None:
    if beta < 1:
        raise ValueError(f"beta (the shallowest/deepest budget ratio) must be a positive integer, got {beta!r}")


def check_layer_schedule(rule: object) -> None:
    if rule not in SCHEDULES:
        raise ValueError(f"layer_schedule must be one of {', '.join(SCHEDULES)}, got {rule!r}")


def pyramid_layer_budget(layer, budget: int, window: int, beta: int, num_layers: int, schedule: str) -> int:
    """One layer's budget (window included) under the pyramid schedule of a uniform `budget`."""
    window = min(window, budget)
    budgets = pyramid_budgets(num_layers, budget - window, layer.seen - window, beta, schedule)
    return budgets[layer.layer_idx] + window


@register_method
@dataclass
class PyramidKV(SnapKV):
    name = "pyramidkv"
    beta: int = 20
    layer_schedule: str = "authors"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_beta(self.beta)
        check_layer_schedule(self.layer_schedule)

    def layer_budget(self, layer, budget, step):
        return pyramid_layer_budget(layer, budget, self.window, self.beta, step.num_layers, self.layer_schedule)
