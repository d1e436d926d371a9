"""KeyL2Norm (Devoto et al. 2024; KeyDiff Table 10): keep, per KV head, the keys with the smallest L2 norm
(kvpress's KnormPress)."""

from __future__ import annotations

from dataclasses import dataclass

from kvbench.methods.base import EvictionMethod, keep_top, register_method


@register_method
@dataclass
class KeyL2Norm(EvictionMethod):
    name = "keyl2norm"

    def keep(self, layer, budget, step):
        if budget >= layer.physical_length():
            return None
        return keep_top(-layer.head_view().keys.float().norm(dim=-1), budget)
