"""Ada-Pyramid (the Ada-KV paper, arXiv:2407.11550, §4): PyramidKV's per-layer budgets, Ada-KV's head-wise
allocation inside each layer: layer l allocates H * b_l outside-window slots with the floor alpha * b_l (with
`rounding=release`, int(alpha * b_l), as the release's `pyram_mode`). `scoring_dtype` and `rounding` are Ada-KV's
(kvbench.methods.adakv); docs/fidelity.md compares both with the release."""

from __future__ import annotations

from dataclasses import dataclass

from kvbench.methods.adakv import AdaKV
from kvbench.methods.base import register_method
from kvbench.methods.pyramidkv import check_beta, check_layer_schedule, pyramid_layer_budget


@register_method
@dataclass
class AdaPyramid(AdaKV):
    name = "ada_pyramid"
    beta: int = 20
    layer_schedule: str = "authors"  # the layers' budgets: kvbench.methods.pyramidkv (authors' floored step, or exact)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_beta(self.beta)
        check_layer_schedule(self.layer_schedule)

    def layer_budget(self, layer, budget, step):
        return pyramid_layer_budget(layer, budget, self.window, self.beta, step.num_layers, self.layer_schedule)
