"""RocketKV's plan and its first stage (SnapKV++) as its release computes them: NVlabs/RocketKV, commit
63637c8eb4b06b5eb83cd687723b0eeb19f48f65.

- `release_plan`: `compress()` in `pipeline/inf_stream_llm/infllm_utils.py` (token capacity from the adaptive
  split r, prompt budget, top-k and the stage-2 compression ratio), and the page size and k1 that
  `rocket_forward` derives from that ratio (`pipeline/inf_stream_llm/inf_llm/attention/rocket.py`).
- `snapkv_plus_plus`: the prefill branch of `rocket_forward` in the same `rocket.py` ("#snapkv"): window
  queries' logits over the repeated keys, -inf above the window's diagonal, softmax (the model's dtype; float32
  here), masked entries zeroed, window rows summed, *summed* over the query heads of a KV group, max-pool
  (kernel 63, padding 31), `topk(prompt_budget - window)` sorted, the window appended. Compressed only when
  the layer holds more than `prompt_budget` keys.
"""

from __future__ import annotations

import math

import torch


def release_plan(max_seq_len: int, token_budget: int, total_max_new_tokens: int, head_dim: int,
                 r_fixed: float | None = None) -> dict:
    compression_ratio = max(1.0, float(max_seq_len) / token_budget)
    r = r_fixed if r_fixed is not None else min(0.2 + math.log2(compression_ratio) * 0.06, 0.8)
    capacity = int(float(max_seq_len) / (compression_ratio ** r))
    capacity = max(capacity, min(2 * total_max_new_tokens, max_seq_len))
    stage2 = max(1.0, float(capacity) / token_budget)
    # rocket_forward: page size ceil(sqrt(ratio)), 1 when that exceeds the ratio; k1 = int(D * page / ratio)
    page = math.ceil(math.sqrt(stage2))
    page = 1 if page > stage2 else page
    return {"capacity": capacity, "prompt_budget": capacity - total_max_new_tokens, "k2": int(token_budget // 2),
            "c2": stage2, "page_size": page, "k1": int(head_dim * page / stage2)}


def snapkv_plus_plus(q: torch.Tensor, k: torch.Tensor, prompt_budget: int, window: int = 32,
                     kernel: int = 63) -> torch.Tensor | None:
    """q `[H_q, L, D]`, k `[H_kv, L, D]`: the sorted outside-window indices `[H_kv, prompt_budget - window]`
    the release keeps (then the window), or None when it keeps everything."""
    heads_q, length, dim = q.shape
    heads_kv = k.shape[0]
    if length <= prompt_budget:
        return None
    window = min(window, length)
    k2 = k.repeat_interleave(heads_q // heads_kv, dim=0)
    dist = torch.arange(window)[:, None] - torch.arange(length)[None, :] + length - window
    visible = dist >= 0
    score = torch.matmul(q[:, -window:], k2.transpose(-1, -2)) / math.sqrt(dim)
    score = score.masked_fill(~visible[None], float("-inf"))
    score = torch.softmax(score, dim=-1).masked_fill(~visible[None], 0)
    score = score[:, -window:, :-window].sum(dim=-2)
    score = score.view(heads_kv, -1, length - window).sum(dim=1)
    score = torch.nn.functional.max_pool1d(score[None], kernel_size=kernel, padding=kernel // 2, stride=1)[0]
    return score.topk(prompt_budget - window, dim=-1).indices.sort().values


def gpt_fast_dense_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          input_pos: int) -> torch.Tensor:
    """The Full-KV baseline of the release's efficiency figure (Fig. 7): `gpt-fast/model.py`
    (`DenseAttentionFunction.forward`: `repeat_interleave` of the whole K/V cache to the query heads, then
    `F.scaled_dot_product_attention(q, k, v, mask)`) with `mask = causal_mask[None, None, input_pos]`, a boolean row
    over the cache's whole `max_seq_length` (`Transformer.forward`), run inside `decode_n_tokens`'s
    `torch.backends.cuda.sdp_kernel(enable_flash=False, enable_mem_efficient=False, enable_math=True)`
    (`gpt-fast/generate.py`: "Actually better for Inductor to codegen attention here"): masked math attention over
    the capacity, K/V repeated. q `[H_q, D]` for the token at `input_pos`, caches `[H_kv, max_seq_length, D]`
    (the token already written at `input_pos`); returns `[H_q, D]`."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    group = q.shape[0] // k_cache.shape[0]
    k = k_cache.repeat_interleave(group, dim=0)[None]
    v = v_cache.repeat_interleave(group, dim=0)[None]
    causal_mask = torch.tril(torch.ones(k_cache.shape[1], k_cache.shape[1], dtype=torch.bool))
    mask = causal_mask[None, None, torch.tensor([input_pos])]
    with sdpa_kernel(SDPBackend.MATH):
        return torch.nn.functional.scaled_dot_product_attention(q[None, :, None, :], k, v, mask)[0, :, 0]
