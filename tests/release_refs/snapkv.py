"""SnapKV, PyramidKV and KVCache-Factory's L2Norm as their releases compute them.

- `snapkv_update_kv`: `SnapKVCluster.update_kv` of FasterDecoding/SnapKV, commit
  e216ddc84c5bd210378cbdbbba12ba02102aa640, `snapkv/monkeypatch/snapkv_utils.py`; the Mistral/Llama hijacks
  (`snapkv/monkeypatch/mistral_hijack_4_37.py`) repeat K/V to every query head *before* it ("[SnapKV] move to
  ahead"), so with GQA each query head selects and stores its own tokens. Its LongBench configs
  (`experiments/LongBench/config/*_w32_k7_maxpool.json`): window 32, max-pool kernel 7.
- The same function with `groups > 1` is the kv_head mode of Zefan-Cai/KVCache-Factory, commit
  c97f9d706d63d1b56e980f8b81b2a924c21162b3, `pyramidkv/pyramidkv_utils.py` (`_grouped_window_attn_cache`,
  `_reduce_group_scores`, `_select_topk_kv`): the keys are repeated only for the score matmul, the window sums
  are reduced over the query heads of a KV group (`gqa_score_agg`, mean by default) before pooling, and each
  KV head keeps one set.
- `pyramid_capacity`: `PyramidKVCluster.update_kv` of the same KVCache-Factory commit and file: the layer's
  outside-window count, including the branch where a prompt shorter than 2 * (capacity - window) falls back to
  SnapKV's uniform count.
- `l2norm_keep`: `L2NormCluster.update_kv` of the same commit and file (KeyL2Norm, Devoto et al. 2024): the keys
  sorted by ascending L2 norm (`argsort`), the first `capacity` kept in that order, no window.

The release's arithmetic, step by step: logits `q @ k^T / sqrt(D)` over the window's queries and every key;
`finfo.min` added above the window's causal diagonal; softmax in float32 (then the model's dtype: float32
here); the window rows summed (not averaged); optional group reduction; 1-D pooling with padding
`kernel // 2` (`avg_pool1d` counts the padding, as the release); `topk(capacity - window)` (torch's top-k: the
release's tie-breaking), gathered in top-k order, then the window appended.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """`[H_kv, L, D]` -> `[H_kv * groups, L, D]`, query head h reading KV head h // groups (transformers' order)."""
    return x[:, None].expand(x.shape[0], groups, *x.shape[1:]).reshape(x.shape[0] * groups, *x.shape[1:])


def window_attention_sums(q: torch.Tensor, k: torch.Tensor, window: int) -> torch.Tensor:
    """`[H_q, L - window]`: the window queries' softmax attention on every earlier key, summed over the window.
    q `[H_q, L, D]`, k `[H_q, L, D]` (already repeated)."""
    head_dim = q.shape[-1]
    logits = torch.matmul(q[:, -window:, :], k.transpose(1, 2)) / math.sqrt(head_dim)
    mask = torch.full((window, window), torch.finfo(logits.dtype).min)
    cond = torch.arange(window)
    mask.masked_fill_(cond < (cond + 1).view(window, 1), 0)
    logits[:, -window:, -window:] += mask
    weights = torch.softmax(logits, dim=-1, dtype=torch.float32).to(q.dtype)
    return weights[:, -window:, :-window].sum(dim=-2)


def pool(scores: torch.Tensor, pooling: str, kernel: int) -> torch.Tensor:
    if pooling == "avgpool":
        return F.avg_pool1d(scores, kernel_size=kernel, padding=kernel // 2, stride=1)
    if pooling == "maxpool":
        return F.max_pool1d(scores, kernel_size=kernel, padding=kernel // 2, stride=1)
    raise ValueError(pooling)


def snapkv_update_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, capacity: int, window: int, kernel: int,
                     pooling: str, groups: int = 1, gqa_score_agg: str = "mean", outside: int | None = None):
    """The release's compression of one layer's prompt. q `[H_q, L, D]`, k/v `[H, L, D]` with H = H_q / groups
    (groups 1: the original SnapKV's repeated K/V). Returns per stored head the kept indices in the release's
    order (top-k order, then the window), and the kept keys and values. `outside` overrides `capacity - window`
    (PyramidKV's per-layer count). A prompt shorter than `capacity` is kept whole."""
    length = q.shape[1]
    if length < capacity:
        idx = torch.arange(length).expand(k.shape[0], length)
        return idx, k, v
    sums = window_attention_sums(q, repeat_kv(k, groups), window)  # [H_q, L - w]
    if groups > 1:
        grouped = sums.reshape(k.shape[0], groups, -1)
        sums = {"mean": grouped.mean(dim=1), "max": grouped.amax(dim=1), "sum": grouped.sum(dim=1)}[gqa_score_agg]
    scores = pool(sums, pooling, kernel)
    top = scores.topk(capacity - window if outside is None else outside, dim=-1).indices
    idx = torch.cat([top, torch.arange(length - window, length).expand(top.shape[0], window)], dim=1)
    gather = idx[..., None].expand(-1, -1, k.shape[-1])
    return idx, k.gather(1, gather), v.gather(1, gather)


def pyramid_capacity(layer_idx: int, num_layers: int, capacity: int, window: int, beta: int, length: int) -> int:
    """Outside-window tokens PyramidKV's release keeps in layer `layer_idx` of a prompt of `length` tokens (the
    prompt is compressed only when `length >= capacity`)."""
    min_num = (capacity - window) // beta
    max_num = (capacity - window) * 2 - min_num
    if max_num >= length - window:
        max_num = length - window
        min_num = (capacity - window) * 2 - max_num
    steps = (max_num - min_num) // (num_layers - 1)
    if length < (capacity - window) * 2:  # the release's middle branch: SnapKV's uniform count
        return capacity - window
    return max_num - layer_idx * steps


def l2norm_keep(k: torch.Tensor, capacity: int) -> torch.Tensor:
    """`[H, capacity]` kept indices in the release's order (ascending key norm), or every index when it fits."""
    length = k.shape[1]
    if length < capacity:
        return torch.arange(length).expand(k.shape[0], length)
    return torch.norm(k, p=2, dim=-1).argsort(dim=-1)[:, :capacity]
