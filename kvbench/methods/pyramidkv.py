"""PyramidKV (Cai et al. 2024; Zhang et al. 2024a in Ada-KV's citations): SnapKV with budgets that shrink
with depth.

The schedule is the PyramidKV code's (specs/adakv.md §2.4, beta 20): with b = budget - window outside-window
slots per head on average and n = tokens seen - window candidates,

    min_num = b // beta;  max_num = 2b - min_num
    if max_num >= n: max_num = n; min_num = 2b - max_num
    b_l = max_num - l * (max_num - min_num) / (num_layers - 1)     (layer l = 0 is the shallowest)

and each layer keeps its top-b_l tokens by SnapKV's scores plus the window. The code floors the step
(`steps = (max_num - min_num) // (num_layers - 1)`), which makes the layers' sum exceed num_layers * b by up
to num_layers^2 / 2 tokens; here the real-valued b_l are rounded by largest remainder instead, so the sum is
exactly the uniform total and the schedule still never increases with depth (a documented deviation, like
Ada-KV's rounding). Block-wise or decode-time eviction recomputes the schedule from the tokens seen so far.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbench.methods.base import register_method
from kvbench.methods.snapkv import SnapKV


def pyramid_budgets(num_layers: int, b: int, candidates: int, beta: int = 20) -> list[int]:
    """Outside-window slots per head for each layer: non-increasing with depth, summing to num_layers * b."""
    if num_layers == 1 or b >= candidates:
        return [b] * num_layers
    min_num = b // beta
    max_num = 2 * b - min_num
    if max_num >= candidates:
        max_num = candidates
        min_num = 2 * b - max_num
    real = [max_num - layer * (max_num - min_num) / (num_layers - 1) for layer in range(num_layers)]
    budgets = [int(x) for x in real]  # every real value is >= 0, so int() floors
    short = num_layers * b - sum(budgets)
    # largest remainder, ties to the shallower layer: the rounded schedule stays non-increasing
    by_remainder = sorted(range(num_layers), key=lambda layer: (-(real[layer] - budgets[layer]), layer))
    for layer in by_remainder[:short]:
        budgets[layer] += 1
    return budgets


def check_beta(beta: object) -> None:
    if isinstance(beta, bool) or not isinstance(beta, int) or beta < 1:
        raise ValueError(f"beta (the shallowest/deepest budget ratio) must be a positive integer, got {beta!r}")


def pyramid_layer_budget(layer, budget: int, window: int, beta: int, num_layers: int) -> int:
    """One layer's budget (window included) under the pyramid schedule of a uniform `budget`."""
    window = min(window, budget)
    schedule = pyramid_budgets(num_layers, budget - window, layer.seen - window, beta)
    return schedule[layer.layer_idx] + window


@register_method
@dataclass
class PyramidKV(SnapKV):
    name = "pyramidkv"
    beta: int = 20

    def __post_init__(self) -> None:
        super().__post_init__()
        check_beta(self.beta)

    def layer_budget(self, layer, budget, step):
        return pyramid_layer_budget(layer, budget, self.window, self.beta, step.num_layers)
