"""The method's eviction hook on one layer: the one place an eviction event starts. The layer's layout asks the
method the hook it needs (`KVLayer.evict`: `keep` on the eager layout, `decode_eviction_scores` on the static one)."""

from __future__ import annotations

from kvbench.cache.layer import KVLayer
from kvbench.core.contract import Step


def evict_layer(layer: KVLayer, step: Step) -> None:
    """One eviction event on one layer: the method picks, per head, what to keep of the layer's budget."""
    if step.method is None or step.budget is None or step.method.is_dense_layer(layer.layer_idx):
        return
    layer.budget = step.method.layer_budget(layer, step.budget, step)
    layer.evict(step.method, step)  # the layer's layout asks the method its hook (`keep`, `decode_eviction_scores`)
