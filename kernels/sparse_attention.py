"""Decode attention over a per-query-head subset of cached tokens (the selection methods' hot path).

`topk_attention` is the PyTorch reference: gather the selected keys/values of each query head and run an
fp32 softmax over them alone (what Exact-TopK, Quest, SparQ and HSA do at each decode step).
"""

from __future__ import annotations

import torch


def topk_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    idx: torch.Tensor,
    scaling: float,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of each query head over its own selected tokens.

    q: [H_kv, G, D]; keys/values: [H_kv, L, D]; idx: [H_kv, G, k] token indices into L (per query head;
    group-shared selection is the same indices repeated over G); valid: optional [H_kv, L] mask of real
    (non-padding) slots of a ragged layer: selected padding gets no weight. Returns [H_kv, G, D] in q's dtype.
    """
    n_kv, group, k = idx.shape
    dim = keys.shape[-1]
    flat = idx.reshape(n_kv, group * k, 1).expand(-1, -1, dim)
    k_sel = keys.gather(1, flat).view(n_kv, group, k, dim).float()
    v_sel = values.gather(1, flat).view(n_kv, group, k, dim).float()
    logits = torch.einsum("hgd,hgkd->hgk", q.float(), k_sel) * scaling
    if valid is not None:
        logits.masked_fill_(~valid.gather(1, idx.reshape(n_kv, -1)).view(n_kv, group, k), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.einsum("hgk,hgkd->hgd", probs, v_sel).to(q.dtype)
