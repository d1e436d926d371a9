"""The method's eviction hook on one layer: the one place an eviction event calls the method."""

from __future__ import annotations

from kvbench.cache.layer import KVLayer
from kvbench.core.contract import Step


def evict_layer(layer: KVLayer, step: Step) -> None:
    """One eviction event on one layer: the method picks, per head, what to keep of the layer's budget."""
    if step.method is None or step.budget is None or step.method.is_dense_layer(layer.layer_idx):
        return
    layer.budget = step.method.layer_budget(layer, step.budget, step)
    keep = step.method.keep(layer, layer.budget, step)
    if keep is not None:
        layer.retain(keep)
