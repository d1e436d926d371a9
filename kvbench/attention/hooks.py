"""The method's eviction hook on one layer: the one place an eviction event calls the method."""

from __future__ import annotations

from kvbench.cache.layer import KVLayer
from kvbench.core.contract import Step


def evict_layer(layer: KVLayer, step: Step) -> None:
    """One eviction event on one layer: the method picks, per head, what to keep of the layer's budget."""
    if step.method is None or step.budget is None or step.method.is_dense_layer(layer.layer_idx):
        return
    layer.budget = step.method.layer_budget(layer, step.budget, step)
    if layer.static is not None:
        _evict_static(layer, step)
        return
    keep = step.method.keep(layer, layer.budget, step)
    if keep is not None:
        layer.retain(keep)


def _evict_static(layer: KVLayer, step: Step) -> None:
    """A decode step's eviction on a static layer: every head over the number of tokens it keeps loses the slot
    of its lowest score (`Method.decode_eviction_scores`). A decode step adds one token per head, so after the
    first decode step of the loop (run eagerly, see `Session`) a head is never more than one token over."""
    scores, keep = step.method.decode_eviction_scores(layer, layer.budget, step)
    st = layer.static
    slot = scores.float().masked_fill(~st.valid(), float("inf")).argmin(dim=-1)
    layer.static_evict(slot, st.fill > keep)
