"""The attention function registered with transformers' `AttentionInterface` as "kvbench".

It is the one dispatcher where the cache's storage meets the model: the first prefill chunk, continuation
chunks (a later prefill block, a question appended to a compressed context, a later turn) and decode steps
(with the method's optional top-k selection). After every attention call the method's per-chunk work runs
on the layer (`_after_attention`): whatever the event (end of the segment, a prefill block, a decode step),
eviction is the same hook on the same layer. The uncompressed prefill and decode calls are the exact SDPA calls that
transformers' own "sdpa" implementation makes on CPU, so an uncompressed run is bitwise identical to stock.

transformers passes no mask under a custom attention name; causality is handled here. A `KVBenchCache` is
one sequence; a `BatchedCache` puts several of them in one forward (one per batch row, each attended on its
own layer), so the dense layers read the weights once for all rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from kvbench.cache import HeadView, KVLayer, active_layers, evict_layer
from kvbench.kernels.ragged_attention import ragged_decode_attention
from kvbench.kernels.sparse_attention import merge_attention, topk_attention
from kvbench.methods.base import Selection

ATTENTION_NAME = "kvbench"


def register_attention() -> None:
    AttentionInterface.register(ATTENTION_NAME, kvbench_attention)


def kvbench_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    for unsupported in ("sliding_window", "s_aux", "softcap"):
        if kwargs.get(unsupported) is not None:
            raise NotImplementedError(f"kvbench attention does not implement {unsupported}")
    if attention_mask is not None:
        raise NotImplementedError("kvbench attention runs without padding masks (each batch row is its own cache)")
    layers = active_layers(key)
    if layers is None:
        raise RuntimeError("kvbench attention needs a KVBenchCache: pass past_key_values=KVBenchCache(...)")
    scaling = scaling if scaling is not None else module.head_dim**-0.5
    if len(layers) == 1:
        return _attend(layers[0], query, scaling), None
    # a batch of caches (BatchedCache): every row attends over its own layer
    return torch.cat([_attend(layer, query[b:b + 1], scaling) for b, layer in enumerate(layers)]), None


def _attend(layer: KVLayer, query: torch.Tensor, scaling: float) -> torch.Tensor:
    """One row: the chunk's attention over the layer, then the method's per-chunk work. [1, q, H_q, D]."""
    q_len = query.shape[2]
    layer.scaling = scaling
    if q_len > 1 and layer.seen == q_len:  # first prefill chunk: stock causal SDPA
        out = F.scaled_dot_product_attention(query, layer.keys, layer.values, scale=scaling, is_causal=True,
                                             enable_gqa=True)
    elif q_len == 1:
        out = _decode(layer, query, scaling)
    else:
        out = _continuation(layer, query, scaling)
    _after_attention(layer, query)
    return out.transpose(1, 2).contiguous()


def _after_attention(layer: KVLayer, query: torch.Tensor) -> None:
    """The method's per-chunk work, right after this layer attended (so the chunk's output saw every entry):
    keep the queries its scores read, let it observe the attention, and evict when the engine says so."""
    cache = layer.cache
    if cache.query_window:
        layer.remember_queries(query[0], cache.query_window)
    if cache.observing:
        cache.method.observe(layer, query[0])
    if cache.evict_now:
        evict_layer(layer)


def _decode(layer: KVLayer, query: torch.Tensor, scaling: float) -> torch.Tensor:
    cache = layer.cache
    method = cache.method
    if method is not None and method.selects and cache.plan is not None and cache.plan.select is not None:
        view = layer.head_view()
        q = query[0, :, 0, :].view(view.keys.shape[0], -1, query.shape[-1])  # [H_kv, G, D]
        selection = method.select(layer, q, view, cache.plan, scaling)
        if selection is not None:
            selection = selection if isinstance(selection, Selection) else Selection(selection)
            out = _selected_attention(layer, q, view, selection, scaling)
            return out.reshape(1, -1, 1, out.shape[-1])
    if method is not None:
        cache.stats.add(layer, method.step_traffic(layer, None), None)
    if not layer.is_ragged:
        return F.scaled_dot_product_attention(query, layer.keys, layer.values, scale=scaling, enable_gqa=True)
    q = query[0, :, 0, :].view(layer.num_heads, -1, query.shape[-1])  # packed GQA: [H_kv, G, D]
    out = ragged_decode_attention(q, layer.keys, layer.values, layer._offsets(), layer.head_lens, scaling)
    return out.reshape(1, -1, 1, out.shape[-1])


def _selected_attention(layer: KVLayer, q: torch.Tensor, view: HeadView, selection: Selection, scaling: float) -> torch.Tensor:
    """Attention of each query head over what the method selected (storage rows, rows from outside merged by
    log-sum-exp, a blended fallback), and the step's accounting. Returns [H_kv, G, D]."""
    cache = layer.cache
    if selection.external is None:
        out = topk_attention(q, view.keys, view.values, selection.idx, scaling, view.valid)
    else:
        out, lse = topk_attention(q, view.keys, view.values, selection.idx, scaling, view.valid, return_lse=True)
        out, _ = merge_attention(out, lse, *_external_attention(q, selection.external, scaling))
    if selection.weight is not None:
        out = (selection.weight * out.float() + (1 - selection.weight) * selection.fallback.float()).to(q.dtype)
    recall = None
    if cache.measure_recall:
        recall = selection.recall if selection.recall is not None else attention_recall(q, view, selection.idx, scaling)
    cache.stats.add(layer, cache.method.step_traffic(layer, selection), recall, selection.moved_bytes, selection.extra)
    return out


def _external_attention(
    q: torch.Tensor, external: tuple, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over rows outside the layer's storage, computed where they live (CTKVR's host rows on the
    CPU; rows a method moved to the device there), with its log-sum-exp, returned on q's device."""
    keys, values, valid = external if len(external) == 3 else (*external, None)
    every = torch.arange(keys.shape[1], device=keys.device).expand(q.shape[0], q.shape[1], -1)
    out, lse = topk_attention(q.to(keys.device), keys, values, every, scaling, valid, return_lse=True)
    return out.to(q.device), lse.to(q.device)


def attention_recall(q: torch.Tensor, view: HeadView, idx: torch.Tensor, scaling: float) -> float:
    """Top-k attention-mass recall of a selection: the exact attention mass on the selected tokens over the
    mass of the exact top-|selected| tokens, per query head, averaged (1 for Exact-TopK). Over the tokens the
    layer holds at this step, so after an eviction stage it is measured on what survived."""
    logits = torch.einsum("hgd,hld->hgl", q.float(), view.keys.float()) * scaling
    if view.valid is not None:
        logits.masked_fill_(~view.valid[:, None, :], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    chosen = probs.gather(-1, idx).sum(-1)
    best = probs.topk(idx.shape[-1], dim=-1).values.sum(-1)
    return float((chosen / best).mean())


def _continuation(layer: KVLayer, query: torch.Tensor, scaling: float) -> torch.Tensor:
    """A multi-token chunk on top of a cache: every stored token is in the past, the chunk is causal.

    The chunk's tokens are the last `q_len` of each head, so the mask is bottom-right aligned per head
    (SDPA's `is_causal` is top-left aligned and would be wrong here).
    """
    q_len = query.shape[2]
    view = layer.head_view()
    keys, values = view.keys, view.values
    lens = torch.tensor(layer.lengths(), device=query.device)
    outside = layer.cache.method.offloaded(layer) if layer.cache.method is not None else None
    if outside is not None:  # rows a method moved off the device are in this chunk's past too (a dense chunk)
        keys = torch.cat([outside.keys.to(keys.device), keys], dim=1)
        values = torch.cat([outside.values.to(values.device), values], dim=1)
        lens = lens + outside.keys.shape[1]
    n_kv, width = keys.shape[0], keys.shape[1]
    slot = torch.arange(width, device=query.device)
    row = torch.arange(q_len, device=query.device)
    # key j visible to chunk row i of head h iff j < len_h - q_len + i + 1
    mask = slot[None, None, :] < (lens[:, None, None] - q_len + row[None, :, None] + 1)  # [H_kv, q, L]
    group = query.shape[1] // n_kv
    mask = mask.repeat_interleave(group, dim=0)[None]
    return F.scaled_dot_product_attention(
        query, keys[None], values[None], attn_mask=mask, scale=scaling, enable_gqa=True
    )
