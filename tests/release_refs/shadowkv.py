"""ShadowKV's landmarks, outlier chunks and chunk selection as its release computes them: bytedance/ShadowKV,
commit a21f5a9ebd7956fe3510b0f29cf13c4fe07ca3b1, `models/kv_cache.py` (`ShadowKVCache.prefill_kv_cache`,
`get_retrieval_position_ids`).

At the end of the prefill of `incoming` tokens: `chunks = incoming // chunk_size - local_chunk`; the last
`incoming - chunks * chunk_size` tokens (the local chunks and the remainder) stay resident; each chunk's
landmark is the mean of its post-RoPE keys; per KV head the `outlier_chunk` chunks with the smallest minimum
cosine similarity between a key and its landmark (`topk(largest=False)`) stay resident; the other chunks'
landmarks are registered in ascending chunk order. Each decode step: `q . landmark / sqrt(128)` (a constant
in the release, whatever the head width), softmax over the chunks in float32, summed over the step's queries
(one), the max over the query heads of a KV group, `topk(sparse_budget // chunk_size)` chunks per KV head.
"""

from __future__ import annotations

import math

import torch


def prefill_landmarks(keys: torch.Tensor, chunk_size: int, local_chunk: int, outlier_chunk: int):
    """keys `[H, n, D]` (post-RoPE). Returns (landmarks `[H, C, D]`, their chunk ids `[H, C]`, outlier chunk ids
    `[H, O]` in top-k order, the number of chunks, the resident tail's length)."""
    heads, incoming, dim = keys.shape
    chunks = incoming // chunk_size - local_chunk
    prefill_local = incoming - chunks * chunk_size
    ctx = keys[:, :chunks * chunk_size].view(heads, chunks, chunk_size, dim)
    candidates = ctx.mean(dim=-2)
    cos_sim = torch.nn.functional.cosine_similarity(candidates.unsqueeze(2).expand(-1, -1, chunk_size, -1), ctx, dim=-1)
    outliers = cos_sim.min(dim=-1).values.topk(outlier_chunk, largest=False).indices
    mask = torch.ones(heads, chunks, dtype=torch.bool).scatter_(-1, outliers, False)
    rest = torch.arange(chunks).expand(heads, -1).masked_select(mask).view(heads, -1)
    landmarks = candidates.gather(1, rest[..., None].expand(-1, -1, dim))
    return landmarks, rest, outliers, chunks, prefill_local


def retrieval_chunks(q: torch.Tensor, landmarks: torch.Tensor, chunk_ids: torch.Tensor, sparse_budget: int,
                     chunk_size: int, temperature_width: int = 128) -> torch.Tensor:
    """q `[H_kv, G, D]`: the chunk ids `[H_kv, sparse_budget // chunk_size]` the step reads (top-k order).
    `temperature_width`: the release's constant 128 (`/ math.sqrt(128)`)."""
    chunk_attn = torch.einsum("hgd,hcd->hgc", q, landmarks) / math.sqrt(temperature_width)
    chunk_attn = torch.softmax(chunk_attn, dim=-1, dtype=torch.float32)
    if q.shape[1] > 1:
        chunk_attn = chunk_attn.max(dim=-2).values
    else:
        chunk_attn = chunk_attn[:, 0]
    top = torch.topk(chunk_attn, k=sparse_budget // chunk_size, dim=-1).indices
    return chunk_ids.gather(-1, top)
