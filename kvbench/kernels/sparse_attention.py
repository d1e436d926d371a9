"""Decode attention over a per-query-head subset of cached tokens (the selection methods' hot path).

Each query head attends to the keys/values it selected (what Exact-TopK, Quest, SparQ and HSA do at each
decode step), with an fp32 softmax over the selected tokens alone. `topk_attention` dispatches between the
Triton kernel (`topk_attention_triton`, CUDA) and the PyTorch reference (`topk_attention_reference`);
both compute the same function, documented on the reference.
"""

from __future__ import annotations

import torch

from kvbench.kernels._dispatch import use_triton
from kvbench.kernels.fusion import realized


def topk_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    idx: torch.Tensor,
    scaling: float,
    valid: torch.Tensor | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`topk_attention_reference`'s result, computed by the Triton kernel when `use_triton` allows it, and by
    `topk_attention_traced` inside the compiled decode step."""
    tensors = (q, keys, values, idx) + ((valid,) if valid is not None else ())
    if use_triton(*tensors):
        return topk_attention_triton(q, keys, values, idx, scaling, valid, return_lse=return_lse)
    if torch.compiler.is_compiling():
        return topk_attention_traced(q, keys, values, idx, scaling, valid, return_lse=return_lse)
    return topk_attention_reference(q, keys, values, idx, scaling, valid, return_lse=return_lse)


def topk_attention_reference(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    idx: torch.Tensor,
    scaling: float,
    valid: torch.Tensor | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of each query head over its own selected tokens (PyTorch).

    q: [H_kv, G, D]; keys/values: [H_kv, L, D]; idx: [H_kv, G, k] int64 token indices into L (per query
    head; a group-shared selection is the same indices repeated over G; repeated indices count repeatedly);
    valid: optional [H_kv, L] bool mask of the real (non-padding) slots of a ragged layer: selected padding
    gets no weight. out[h, g] = softmax(scaling * q[h, g] . keys[h, idx[h, g]]) @ values[h, idx[h, g]],
    computed in fp32 and returned as [H_kv, G, D] in q's dtype. A query head whose selection is all padding
    gets NaN (a softmax over nothing). With `return_lse`, also the log-sum-exp of each head's selected logits
    ([H_kv, G] fp32, natural log, -inf over nothing), with which partial attentions over disjoint token sets
    merge exactly: out = sum_i exp(lse_i - lse) out_i with lse = logsumexp_i(lse_i).
    """
    n_kv, group, k = idx.shape
    dim = keys.shape[-1]
    # Rows are copied by advanced indexing (whole D-element rows; `gather` with an index expanded over D was
    # 3-4x slower on CPU) into contiguous [H_kv, G, k, D] fp32 tensors, so the einsums below run the same
    # products whether the selection is per query head or shared by the group (bitwise).
    heads = torch.arange(n_kv, device=idx.device)[:, None]
    if group > 1 and idx.stride(1) == 0:  # one selection per KV group (expanded): gather its rows once
        rows = idx[:, 0]
        k_sel = keys[heads, rows][:, None].expand(n_kv, group, k, dim).float().contiguous()
        v_sel = values[heads, rows][:, None].expand(n_kv, group, k, dim).float().contiguous()
    else:
        rows = idx.reshape(n_kv, group * k)
        k_sel = keys[heads, rows].view(n_kv, group, k, dim).float()
        v_sel = values[heads, rows].view(n_kv, group, k, dim).float()
    # the batched products einsum("hgd,hgkd->hgk") and einsum("hgk,hgkd->hgd") run (bitwise the same, tested),
    # called directly: einsum parses its equation on every call of every decode step
    rows_of = n_kv * group
    logits = torch.bmm(q.float().reshape(rows_of, 1, dim), k_sel.reshape(rows_of, k, dim).transpose(1, 2))
    logits = logits.view(n_kv, group, k) * scaling
    if valid is not None:
        logits.masked_fill_(~valid.gather(1, idx.reshape(n_kv, -1)).view(n_kv, group, k), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    out = torch.bmm(probs.reshape(rows_of, 1, k), v_sel.reshape(rows_of, k, dim)).view(n_kv, group, dim).to(q.dtype)
    return (out, torch.logsumexp(logits, dim=-1)) if return_lse else out


def topk_attention_traced(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    idx: torch.Tensor,
    scaling: float,
    valid: torch.Tensor | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`topk_attention_reference` written for inductor (the compiled decode step): the same function, summed in
    another order (equal up to float rounding; the compiled step's tokens are checked against the eager ones).

    Inductor lowers a batched product with one query row (`[B, 1, D] @ [B, D, k]`, the reference's per-query-head
    shape) on CPU to an inlined multiply-and-sum, into which it fuses the row gather and the query's rotary
    embedding: on a bf16 RocketKV step at 8K that kernel took 220-330 us per layer for 128 rows. Here each KV
    head runs one product with its G query heads as rows (`[H_kv, G, D] @ [H_kv, D, m]`), a BLAS call over
    rows gathered once (40 us per layer for 3 KV heads x 3 query heads x 128 rows on two cores). A selection
    shared by the group gathers its k rows (m = k); a per-query-head one gathers the G*k rows of the whole
    group (m = G*k) and each query head's logits outside its own k are masked: G times the products of a tiny
    matrix, still one BLAS call. With one query head per KV head the product has one row again, and the
    query is computed once first (`realized`), so that nothing is recomputed per row."""
    n_kv, group, k = idx.shape
    shared = group == 1 or idx.stride(1) == 0
    rows = idx[:, 0] if shared else idx.reshape(n_kv, group * k)
    heads = torch.arange(n_kv, device=idx.device)[:, None]
    q = realized(q) if group == 1 else q
    logits = torch.bmm(q.float(), keys[heads, rows].float().transpose(1, 2)) * scaling  # [H_kv, G, m]
    keep = None if valid is None else valid.gather(1, rows)[:, None, :]
    if not shared:  # query head g reads columns g*k .. (g+1)*k - 1
        own = torch.arange(group * k, device=idx.device)[None, :] // k == torch.arange(group, device=idx.device)[:, None]
        keep = own[None] if keep is None else keep & own[None]
    if keep is not None:
        logits = logits.masked_fill(~keep, float("-inf"))
    out = torch.bmm(torch.softmax(logits, dim=-1), values[heads, rows].float()).to(q.dtype)
    return (out, torch.logsumexp(logits, dim=-1)) if return_lse else out


def topk_attention_triton(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    idx: torch.Tensor,
    scaling: float,
    valid: torch.Tensor | None = None,
    return_lse: bool = False,
    block_k: int = 64,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`topk_attention_reference` as a Triton kernel: one program per (KV head, group member).

    Each program gathers its selected K/V rows `block_k` indices at a time and folds them into an online
    softmax with fp32 accumulation. Indices are not bounds-checked (the reference's gather is): every
    idx value must lie in [0, L). Runs on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1.
    """
    n_kv, group, _ = idx.shape
    dim = q.shape[-1]
    if q.shape[:2] != (n_kv, group) or keys.shape[0] != n_kv or keys.shape != values.shape or keys.shape[-1] != dim:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, keys {tuple(keys.shape)}, "
                         f"values {tuple(values.shape)}, idx {tuple(idx.shape)}")
    # a local import: triton is imported on the first launch, not with kvbench (see _dispatch)
    from kvbench.kernels._triton_kernels import launch_topk_attention

    out, lse = launch_topk_attention(q, keys, values, idx, scaling, valid, block_k)
    return (out, lse) if return_lse else out


def merge_attention(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention over the union of two disjoint token sets from each set's attention and log-sum-exp.

    out_*: [H_kv, G, D]; lse_*: [H_kv, G] (natural log). Returns (out, lse) with lse = logaddexp(lse_a, lse_b)
    and out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b, in fp32 then out_a's dtype. A side over no
    token (lse -inf) contributes nothing.
    """
    lse = torch.logaddexp(lse_a, lse_b)
    wa = torch.exp(lse_a - lse).nan_to_num(0.0)[..., None]
    wb = torch.exp(lse_b - lse).nan_to_num(0.0)[..., None]
    out = wa * out_a.float().nan_to_num(0.0) + wb * out_b.float().nan_to_num(0.0)
    return out.to(out_a.dtype), lse
