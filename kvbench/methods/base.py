"""The method interface: a method is a small dataclass with up to two hooks.

- `prefill_keep(layer, obs_queries, budget)`: called once per layer at the end of the segment being
  compressed (the prompt, or the context alone in question-agnostic mode). Returns, per KV head, the sorted
  indices of the tokens to keep, or None to keep everything. The cache then really frees the rest.
- `select(layer, q, view, budget, scaling)`: called at every decode step. Returns `[H_kv, G, k]` indices of
  the cached tokens each query head attends to, or None for all of them.

Budgets are tokens per KV head (the RocketKV / Ada-KV unit). A budget at or above the segment length means
no compression; hooks return None then, and the engine records `compressed: false`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

if TYPE_CHECKING:
    from kvbench.cache import HeadView, KVLayer

METHODS: dict[str, type["Method"]] = {}


def register_method(cls: type["Method"]) -> type["Method"]:
    METHODS[cls.name] = cls
    return cls


@dataclass
class Method:
    name: ClassVar[str] = "base"
    family: ClassVar[str] = "none"  # eviction | selection | two-stage | none
    selects: ClassVar[bool] = False
    uses_budget: ClassVar[bool] = True  # False: the budget cannot change a result (full), so sweeps share one point

    @property
    def obs_window(self) -> int:
        """How many final prefill queries `prefill_keep` needs (0: none)."""
        return 0

    def prefill_keep(
        self, layer: "KVLayer", obs_queries: torch.Tensor | None, budget: int
    ) -> list[torch.Tensor] | None:
        return None

    def select(
        self, layer: "KVLayer", q: torch.Tensor, view: "HeadView", budget: int, scaling: float
    ) -> torch.Tensor | None:
        return None

    def params(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
