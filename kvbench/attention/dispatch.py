"""The attention function registered with transformers' `AttentionInterface` as "kvbench".

It is the one dispatcher where the cache's storage meets the model: the first prefill chunk, continuation
chunks (a later prefill block, a question appended to a compressed context, a later turn) and decode steps
(with the method's optional top-k selection). After every attention call the method's per-chunk work runs
on the layer (`_after_attention`): whatever the event (end of the segment, a prefill block, a decode step),
eviction is the same hook on the same layer. Every method's dense decode step runs the one decode attention
(`kvbench.kernels.decode_attention`); the uncompressed prefill call, and the decode call in float32 on CPU, are
the exact SDPA calls transformers' own "sdpa" implementation makes, so an uncompressed float32 run is bitwise
identical to stock.

transformers passes no mask under a custom attention name; causality is handled here. A `KVBenchCache` is
one sequence; a `BatchedCache` puts several of them in one forward (one per batch row, each attended on its
own layer), so the dense layers read the weights once for all rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from kvbench.attention.hooks import evict_layer
from kvbench.attention.selected import selected_attention
from kvbench.cache.layer import KVLayer
from kvbench.core.contract import Selection, Step
from kvbench.core.stages import stage

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
    steps = kwargs.get("kvbench_steps")
    if steps is None:
        raise RuntimeError("kvbench attention needs the forward's steps: run the model through kvbench.engine.Session "
                           "(model(..., cache=cache, kvbench_steps=[session.step_context()]); past_key_values= before "
                           "transformers 5.24)")
    if len(steps) != query.shape[0]:
        raise RuntimeError(f"{len(steps)} kvbench steps for a batch of {query.shape[0]} rows")
    scaling = scaling if scaling is not None else module.head_dim**-0.5
    if len(steps) == 1:
        return _attend(_layer(steps[0], module), steps[0], query, scaling), None
    # a batch of caches (BatchedCache): every row attends over its own layer; a padding row (no step) attends to
    # nothing and its output, which no real row reads, is zero
    return torch.cat([_attend(_layer(step, module), step, query[b:b + 1], scaling) if step is not None
                      else query.new_zeros(1, query.shape[2], query.shape[1], query.shape[3])
                      for b, step in enumerate(steps)]), None


def _layer(step: Step, module: torch.nn.Module) -> KVLayer:
    """The layer this forward just updated. A forward that silently used a cache of its own (transformers
    creates a DynamicCache when none is passed) updated none of ours, and fails here."""
    layer = step.cache.layers[module.layer_idx]
    if not layer.fresh:
        raise RuntimeError(f"layer {module.layer_idx} of the step's KVBenchCache was not updated by this forward: "
                           "pass the session's cache (`cache=`, or `past_key_values=` before transformers 5.24)")
    layer.fresh = False
    return layer


def _attend(layer: KVLayer, step: Step, query: torch.Tensor, scaling: float) -> torch.Tensor:
    """One row: the chunk's attention over the layer, then the method's per-chunk work. [1, q, H_q, D]."""
    q_len = query.shape[2]
    layer.scaling = scaling
    own = _own_chunk_attention(layer, step, query, scaling) if q_len > 1 else None
    if own is not None:  # the method attends this chunk itself (InfLLM's chunked prefill)
        out = own[None]
    elif q_len > 1 and layer.seen == q_len:  # first prefill chunk: stock causal SDPA, or the engine's sparse prefill
        if step.prefill_attention is not None:  # MInference's (engine.prefill_attention)
            out = step.prefill_attention(layer.layer_idx, query, layer.keys, layer.values, scaling)
        else:
            out = F.scaled_dot_product_attention(query, layer.keys, layer.values, scale=scaling, is_causal=True,
                                                 enable_gqa=True)
    elif q_len == 1:
        out = _decode(layer, step, query, scaling)
    else:
        out = _continuation(layer, step, query, scaling)
    _after_attention(layer, step, query)
    return out.transpose(1, 2).contiguous()


def _own_chunk_attention(layer: KVLayer, step: Step, query: torch.Tensor, scaling: float) -> torch.Tensor | None:
    """A selecting method's own attention of a multi-token chunk (`Method.chunk_attention`), or None."""
    method = step.method
    if method is None or step.plan is None or step.plan.select is None or method.is_dense_layer(layer.layer_idx):
        return None
    return method.chunk_attention(layer, query[0], step, scaling)


def _after_attention(layer: KVLayer, step: Step, query: torch.Tensor) -> None:
    """The method's per-chunk work, right after this layer attended (so the chunk's output saw every entry):
    keep the queries its scores read, let it observe the attention, and evict when the step says so."""
    if step.query_window:
        layer.remember_queries(query[0], step.query_window)
    if step.observe and not step.method.is_dense_layer(layer.layer_idx):
        layer.observe(step.method, query[0], step)
    if step.evict:
        evict_layer(layer, step)


def _decode(layer: KVLayer, step: Step, query: torch.Tensor, scaling: float) -> torch.Tensor:
    method, plan = step.method, step.plan
    if (method is not None and method.selects and plan is not None and plan.select is not None
            and not method.is_dense_layer(layer.layer_idx)):
        view = layer.head_view()
        q = query[0, :, 0, :].view(view.keys.shape[0], -1, query.shape[-1])  # [H_kv, G, D]
        with stage("select"):
            selection = method.select(layer, q, view, step, scaling)
        if selection is not None:
            selection = selection if isinstance(selection, Selection) else Selection(selection)
            with stage("attention"):
                out = selected_attention(layer, step, q, view, selection, scaling)
            return out.reshape(1, -1, 1, out.shape[-1])
    q = query[0, :, 0, :].view(layer.num_heads, -1, query.shape[-1])  # packed GQA: [H_kv, G, D]
    # RocketKV's and gpt-fast's Full-KV baseline reads the K/V repeated to every query head (`Method.repeats_kv`)
    repeats = method is not None and method.repeats_kv
    with stage("attention"):  # the layer's layout attends: its buffers' rows (eager), or its fixed capacity (static)
        out = layer.dense_decode(q, scaling, repeats)
    if method is not None:
        copies = q.shape[1] if repeats else 1
        layer.cache.stats.add(layer, copies * method.step_traffic(layer, None, step), None,
                              layer.held_tokens() / layer.num_heads)
    return out.reshape(1, -1, 1, out.shape[-1])


def _continuation(layer: KVLayer, step: Step, query: torch.Tensor, scaling: float) -> torch.Tensor:
    """A multi-token chunk on top of a cache: every stored token is in the past, the chunk is causal.

    The chunk's tokens are the last `q_len` of each head, so the mask is bottom-right aligned per head
    (SDPA's `is_causal` is top-left aligned and would be wrong here).
    """
    q_len = query.shape[2]
    view = layer.head_view()
    keys, values = view.keys, view.values
    lens = torch.tensor(layer.lengths(), device=query.device)
    method = step.method
    context = None
    if method is not None and step.plan is not None and step.plan.select is not None \
            and not method.is_dense_layer(layer.layer_idx):
        context = method.chunk_context(layer, query[0], step, scaling)
    if context is not None:  # the method's past rows, then the chunk's own (each head's last q_len rows)
        own = (lens[:, None] - q_len + torch.arange(q_len, device=query.device)).clamp(min=0)
        own = own[..., None].expand(-1, -1, keys.shape[-1])
        keys = torch.cat([context[0].to(keys.device), keys.gather(1, own)], dim=1)
        values = torch.cat([context[1].to(values.device), values.gather(1, own)], dim=1)
        lens = torch.full_like(lens, keys.shape[1])
    elif (outside := method.offloaded(layer) if method is not None else None) is not None:
        # rows a method moved off the device are in this chunk's past too (a dense chunk)
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
