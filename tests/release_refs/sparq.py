"""SparQ attention as its two releases compute it, one decode query per head.

`sparq_gpt_fast`: graphcore-research/sparq-gpt-fast, commit 4ebdcdf48485ed9517d26da6ed78cd394aa69a28, `sparq.py`
(`sparq_attn`, `get_r_k_for_compression_ratio`, `RunningVMean`): K and V repeated to every query head; per query
head the r largest |q| dimensions, `s_hat = softmax(q[r] @ K[:, r]^T / scale)` with
`scale = sqrt(D * sum|q[r]| / sum|q|)`, the top k of `s_hat` (torch's top-k), exact attention over them, then
`lerp(V_mean, y, sum of s_hat over the top k)` with the running mean of every value (float32);
r = round(D / ratio), k = round(S / (2 ratio)).

`sparq_decode`: graphcore-research/llm-inference-research, commit ead9b6a70e3304e4666ae887cd2c6f506525fea2,
`llminference/methods/ann_attention.py` (`SparseQ.forward`, `AnnAttention.forward`, `AnnAttention._attention`),
the paper's experiment code:

Per KV group: the r dimensions of largest |q| summed over the group's query heads; each query head's
approximate logits `(q[r] / scale) @ K[:, r]^T` with `scale = sqrt(D * sum|q[r]| / sum|q|)`; the newest
`local_k + 1` keys (the current token comes "for free") get `finfo.max`; the approximate *logits* are summed
over the group's query heads and the top `k + 1` keys are kept, shared by the group; `kv_weight`, the
approximate softmax mass of those keys per query head; exact attention over them (`q / sqrt(D)`), scaled by
`kv_weight`, plus `(1 - kv_weight)` times the mean of every visible value.
"""

from __future__ import annotations

import torch


def sparq_decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, r: int, k: int, local_k: int,
                 reallocate: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """q `[H_kv, G, D]` (one query per head), keys/values `[H_kv, S, D]`, every key visible. Returns the output
    `[H_kv, G, D]` and the kept indices `[H_kv, k + 1]` (top-k order)."""
    heads, group, dim = q.shape
    length = keys.shape[1]
    query = q[:, :, None, :]  # [H, G, 1, D]
    key = keys[:, None]  # [H, 1, S, D]
    top_dims = query.abs().sum(dim=1, keepdim=True).topk(dim=-1, k=r).indices  # [H, 1, 1, r]
    query_proj = query.gather(-1, top_dims.expand(heads, group, 1, r))
    key_proj = key.gather(-1, top_dims.expand(heads, 1, length, r))
    scale = query_proj.abs().sum(-1).div_(query.abs().sum(-1)).mul_(dim).pow_(0.5).unsqueeze(-1)
    score = (query_proj.div(scale) @ key_proj.transpose(-1, -2)).float()  # [H, G, 1, S]
    causal_index = torch.arange(length - 1, -1, -1)  # every key visible: distance back from the query
    is_local = causal_index < local_k + 1
    topk_score = score.masked_fill(is_local, torch.finfo(score.dtype).max).sum(dim=1, keepdim=True)
    indices = topk_score.topk(min(k + 1, length), -1).indices  # [H, 1, 1, k + 1]
    mean_value = values.sum(-2, dtype=torch.float32, keepdim=True).div_(length)[:, None]  # [H, 1, 1, D]
    kv_weight = torch.tensor(1.0)
    if reallocate:
        kv_weight = torch.softmax(score, -1).gather(-1, indices.expand(heads, group, 1, -1)).sum(-1)  # [H, G, 1]
    kv_idx = indices[:, 0, 0]  # [H, k + 1]
    sel_k = keys.gather(1, kv_idx[..., None].expand(-1, -1, dim))[:, None]
    sel_v = values.gather(1, kv_idx[..., None].expand(-1, -1, dim))[:, None]
    scores = query.div(dim ** 0.5) @ sel_k.transpose(-1, -2)
    weights = torch.softmax(scores, -1, dtype=torch.float32) * kv_weight[..., None]
    out = weights @ sel_v + (1 - kv_weight[..., None]) * mean_value
    return out[:, :, 0], kv_idx


def sparq_gpt_fast(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, r: int, k: int):
    """q `[H_q, D]`, keys/values `[H_kv, S, D]` (repeated here to the query heads), every key visible. Returns the
    output `[H_q, D]` and the selected indices `[H_q, k]` (top-k order)."""
    heads_q, dim = q.shape
    group = heads_q // keys.shape[0]
    K = keys.repeat_interleave(group, dim=0)
    V = values.repeat_interleave(group, dim=0)
    Q = q[:, None, :]  # [H, 1, D]
    abs_q = torch.abs(Q)
    abs_q_hat, i1 = torch.topk(abs_q, r, dim=-1, sorted=False)
    qk_hat = Q.gather(-1, i1) @ K.gather(-1, i1.expand(-1, K.shape[1], -1)).transpose(-1, -2)
    scale = torch.sqrt(dim * abs_q_hat.sum(dim=-1, keepdim=True) / abs_q.sum(dim=-1, keepdim=True))
    s_hat = torch.softmax(qk_hat / scale, dim=-1)
    k = min(k, V.shape[-2])
    s_hat_i2, i2 = torch.topk(s_hat, k, dim=-1, sorted=False)
    idx = i2[:, 0, :, None].expand(-1, -1, dim)
    s = torch.softmax((Q @ K.gather(1, idx).transpose(1, 2)) / dim ** 0.5, dim=-1)
    y = s @ V.gather(1, idx)
    v_mean = values.mean(-2, dtype=torch.float32, keepdim=True).repeat_interleave(group, dim=0)
    return torch.lerp(v_mean, y, s_hat_i2.sum(-1, keepdim=True))[:, 0], i2[:, 0]
