"""KeyL2Norm (Devoto et al. 2024; KeyDiff Table 10): keep, per KV head, the keys with the smallest L2 norm
(kvpress's KnormPress). Against KVCache-Factory's `L2NormCluster` on the same tensors: docs/fidelity.md."""

from __future__ import annotations

from dataclasses import dataclass

from kvbench.methods.base import ScoredEviction, register_method


@register_method
@dataclass
class KeyL2Norm(ScoredEviction):
    name = "keyl2norm"

    def score(self, layer, step):
        return -layer.head_view().keys.float().norm(dim=-1)
