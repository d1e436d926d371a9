"""A dense reference for compressed runs: a stock DynamicCache plus an eager attention function in which each
head sees, of the tokens before the current chunk, only those our cache held when that chunk was attended (at
their original positions), and the chunk's own tokens causally. If our cache's logits match this, eviction
(at the end of a segment, after each prefill block, at decode steps) and ragged or per-query-head storage are
exactly what they claim."""

from __future__ import annotations

import torch
from transformers import AttentionInterface, DynamicCache

from kvbench.models import cache_kwargs

REF_NAME = "kvbench_masked_reference"
_visible: dict[int, torch.Tensor] = {}  # layer -> [H_kv or H_q, chunk start] bool: the past each head sees


def _reference_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    n_q, n_kv, total = query.shape[1], key.shape[1], key.shape[2]
    group = n_q // n_kv
    q_len = query.shape[2]
    k = key.repeat_interleave(group, dim=1).float()
    v = value.repeat_interleave(group, dim=1).float()
    logits = torch.einsum("bhqd,bhkd->bhqk", query.float(), k) * scaling
    q_pos = torch.arange(total - q_len, total)[:, None]
    k_pos = torch.arange(total)[None, :]
    allowed = (k_pos <= q_pos)[None].repeat(n_q, 1, 1)  # [H_q, q, T]
    past = _visible.get(module.layer_idx)
    if past is not None:
        if past.shape[0] == n_kv:
            past = past.repeat_interleave(group, dim=0)
        allowed[:, :, : past.shape[1]] &= past[:, None, :]
    logits = logits.masked_fill(~allowed[None], float("-inf"))
    out = torch.softmax(logits, dim=-1) @ v
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


AttentionInterface.register(REF_NAME, _reference_attention)


def kept_masks(cache, length: int) -> dict[int, torch.Tensor]:
    """Per layer, which of the positions 0..length-1 each stored head of a KVBenchCache holds."""
    masks = {}
    for layer in cache.layers:
        pos = layer.head_view().positions
        mask = torch.zeros(pos.shape[0], length, dtype=torch.bool)
        for h in range(pos.shape[0]):
            p = pos[h][(pos[h] >= 0) & (pos[h] < length)].long()
            mask[h, p] = True
        masks[layer.layer_idx] = mask
    return masks


@torch.inference_mode()
def reference_chunks(model, chunks: list[list[int]], past: list[dict[int, torch.Tensor] | None]) -> list[torch.Tensor]:
    """Last-token logits after each chunk; `past[c]` is what each head saw of the tokens before chunk c (the
    kept masks after chunk c - 1), or None for everything."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(REF_NAME)
    try:
        cache = DynamicCache(config=model.config)
        pos, outs = 0, []
        for chunk, visible in zip(chunks, past):
            _visible.clear()
            _visible.update(visible or {})
            ids = torch.tensor([chunk])
            position_ids = torch.arange(pos, pos + len(chunk))[None]
            out = model(input_ids=ids, position_ids=position_ids, **cache_kwargs(model, cache),
                        use_cache=True, logits_to_keep=1)
            outs.append(out.logits[0, -1].float())
            pos += len(chunk)
        return outs
    finally:
        model.set_attn_implementation(previous)
        _visible.clear()


def reference_logits(model, segment: list[int], visible: dict[int, torch.Tensor], feed: list[list[int]]):
    """Logits after a dense segment compressed once to `visible`, then after each chunk in `feed`."""
    past, length = [None], len(segment)
    for chunk in feed:
        past.append({i: torch.cat([m, torch.ones(m.shape[0], length - m.shape[1], dtype=torch.bool)], dim=1)
                     for i, m in visible.items()})
        length += len(chunk)
    return reference_chunks(model, [segment, *feed], past)
