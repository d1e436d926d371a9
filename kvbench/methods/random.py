"""Random eviction (kvpress's RandomPress): keep, per KV head, `budget` of the stored tokens drawn uniformly at
random, the floor any scoring method has to beat. It draws from the sample's generator (`step.generator`), so a
point draws the same alone as in a grouped run and on a rerun, and two samples draw differently."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench.methods.base import ScoredEviction, register_method


@register_method
@dataclass
class Random(ScoredEviction):
    name = "random"

    def score(self, layer, step):
        view = layer.head_view()
        # drawn on the CPU, where the generator is: the same draws on every device
        return torch.rand(view.positions.shape, generator=step.generator).to(view.keys.device)

    def static_decode_blocker(self):
        if self.schedule().decode_every:  # a compiled step cannot draw from a host generator
            return "random eviction draws each decode step's scores from the sample's generator on the host"
        return super().static_decode_blocker()
