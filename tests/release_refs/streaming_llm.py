"""StreamingLLM as its release computes it: mit-han-lab/streaming-llm, commit 2e5042606d69933d88fbf909bd77907456b9b4dd,
`streaming_llm/kv_cache.py` (`StartRecentKVCache`), `examples/eval_long_ppl.py` and
`examples/run_streaming_llama.py` (when it is called), `streaming_llm/pos_shift/modify_llama.py` (positions).

`__call__` after a forward: more than `start_size + recent_size` stored keys -> keep the first `start_size`
and the last `recent_size` (`evict_for_space(n)` before a forward of n tokens does the same leaving room for
them). The pos-shift attention caches keys *before* RoPE and rotates the cached keys by their index in the
cache (`key_position_ids = arange(kv_seq_len)`) and the query by the last index, so attention sees distances
inside the cache rather than in the text; `rope_attention_output` computes both readings on the same
pre-RoPE tensors.
"""

from __future__ import annotations

import math

import torch


def start_recent_indices(length: int, start_size: int, recent_size: int) -> list[int]:
    """The stored indices the release keeps of `length` (all of them while they fit)."""
    if length <= start_size + recent_size:
        return list(range(length))
    return list(range(start_size)) + list(range(length - recent_size, length))


def rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Llama's rotary embedding (rotate_half form) of `[H, n, D]` at `positions` `[n]`."""
    dim = x.shape[-1]
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    angles = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([angles, angles], dim=-1)
    cos, sin = emb.cos(), emb.sin()
    half = dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def rope_attention_output(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, key_positions: torch.Tensor,
                          query_position: int) -> torch.Tensor:
    """One query per head `[H, D]` over pre-RoPE `[H, n, D]` keys rotated to `key_positions`."""
    qr = rope(q[:, None], torch.tensor([query_position]))[:, 0]
    kr = rope(keys, key_positions)
    probs = torch.softmax(torch.einsum("hd,hnd->hn", qr, kr) / math.sqrt(q.shape[-1]), dim=-1)
    return torch.einsum("hn,hnd->hd", probs, values)
