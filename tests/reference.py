"""A dense reference for compressed runs: a stock DynamicCache plus an eager attention function in which each
KV head sees only the tokens it kept from the compressed segment (at their original positions) and every
token after it. If our cache's logits match this, eviction and ragged storage are exactly what they claim."""

from __future__ import annotations

import torch
from transformers import AttentionInterface, DynamicCache

REF_NAME = "kvbench_masked_reference"
_visible: dict[int, torch.Tensor] = {}  # layer -> [H_kv, segment_len] bool
_segment_len = 0


def _reference_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    n_kv, total = key.shape[1], key.shape[2]
    group = query.shape[1] // n_kv
    q_len = query.shape[2]
    k = key.repeat_interleave(group, dim=1).float()
    v = value.repeat_interleave(group, dim=1).float()
    logits = torch.einsum("bhqd,bhkd->bhqk", query.float(), k) * scaling
    q_pos = torch.arange(total - q_len, total)[:, None]
    k_pos = torch.arange(total)[None, :]
    allowed = (k_pos <= q_pos).expand(q_len, total).clone()  # [q, T]
    allowed = allowed[None].repeat(n_kv, 1, 1)  # [H_kv, q, T]
    seg = _visible.get(module.layer_idx)
    if seg is not None:
        after_segment = q_pos[:, 0] >= _segment_len
        allowed[:, after_segment, :_segment_len] &= seg[:, None, :]
    allowed = allowed.repeat_interleave(group, dim=0)[None]
    logits = logits.masked_fill(~allowed, float("-inf"))
    out = torch.softmax(logits, dim=-1) @ v
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


AttentionInterface.register(REF_NAME, _reference_attention)


def kept_masks(cache, segment_len: int) -> dict[int, torch.Tensor]:
    """Per layer, which segment positions each KV head still holds in a KVBenchCache."""
    masks = {}
    for layer in cache.layers:
        pos = layer.head_view().positions
        mask = torch.zeros(pos.shape[0], segment_len, dtype=torch.bool)
        for h in range(pos.shape[0]):
            p = pos[h][(pos[h] >= 0) & (pos[h] < segment_len)].long()
            mask[h, p] = True
        masks[layer.layer_idx] = mask
    return masks


@torch.inference_mode()
def reference_logits(model, segment: list[int], visible: dict[int, torch.Tensor], feed: list[list[int]]):
    """Logits after the segment and after each chunk in `feed`, under the masked reference attention."""
    global _segment_len
    previous = model.config._attn_implementation
    _visible.clear()
    _visible.update(visible)
    _segment_len = len(segment)
    model.set_attn_implementation(REF_NAME)
    try:
        cache = DynamicCache(config=model.config)
        pos = 0
        outs = []
        for chunk in [segment, *feed]:
            ids = torch.tensor([chunk])
            position_ids = torch.arange(pos, pos + len(chunk))[None]
            out = model(input_ids=ids, position_ids=position_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            outs.append(out.logits[0, -1].float())
            pos += len(chunk)
        return outs
    finally:
        model.set_attn_implementation(previous)
        _visible.clear()
