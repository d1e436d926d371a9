"""Attention over what a selection method chose: storage rows, rows kept outside the storage (merged by
log-sum-exp), a blended fallback; the step's traffic accounting and top-k attention-mass recall."""

from __future__ import annotations

import torch

from kvbench.cache.layer import KVLayer
from kvbench.core.contract import HeadView, Selection, Step
from kvbench.core.stages import stage
from kvbench.kernels.exact_scores import exact_logits
from kvbench.kernels.sparse_attention import merge_attention, topk_attention
from kvbench.methods.common.placement import mass_recall_tensor


def selected_attention(layer: KVLayer, step: Step, q: torch.Tensor, view: HeadView, selection: Selection,
                       scaling: float) -> torch.Tensor:
    """Attention of each query head over what the method selected (storage rows, rows from outside merged by
    log-sum-exp, a blended fallback), and the step's accounting. Returns [H_kv, G, D]."""
    if selection.external is None:  # the layer's layout attends (the static one on CUDA: the split-K operator)
        out = layer.attend_selected(q, view, selection.idx, scaling)
    else:  # the stored rows and the rows from outside (CTKVR's host rows: where they live), merged
        with stage("stored"):
            out, lse = topk_attention(q, view.keys, view.values, selection.idx, scaling, view.valid, return_lse=True)
        with stage("external"):
            external = _external_attention(q, selection.external, scaling)
        out, _ = merge_attention(out, lse, *external)
    if selection.weight is not None:
        out = (selection.weight * out.float() + (1 - selection.weight) * selection.fallback.float()).to(q.dtype)
    recall = None
    if step.measure_recall:
        recall = selection.recall if selection.recall is not None else attention_recall(q, view, selection.idx, scaling)
    elements, attended = step.method.step_traffic(layer, selection, step), attended_per_head(selection)
    layer.account_selected_step(elements, recall, attended, selection, view)
    return out


def attended_per_head(selection: Selection) -> float | torch.Tensor:
    """Rows each query head attended this step, averaged over the query heads: its selected storage rows plus
    the (valid) rows from outside the storage (a blended fallback is not a row)."""
    attended = float(selection.idx.shape[-1])
    if selection.external is not None and len(selection.external) == 4:  # each query head's own sampled rows
        log_weights = selection.external[3]  # counted where they are, read once per sample (`DecodeStats`)
        return attended + torch.isfinite(log_weights).sum().double() / (log_weights.shape[0] * log_weights.shape[1])
    if selection.external is not None:
        keys, _, valid = _unpack(selection.external)
        return attended + (valid.sum().double() / valid.shape[0] if valid is not None else keys.shape[1])
    return attended


def _unpack(external: tuple) -> tuple:
    """(keys, values, valid or None) of a selection's rows from outside the storage."""
    return tuple(external[:3]) if len(external) >= 3 else (*external, None)


def _weighted_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor | None,
                        log_weights: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of every query head of a group over rows `keys`/`values` [H_kv, m, D] whose logits carry a
    per-query-head additive `log_weights` [H_kv, G, m] (fp32): (out [H_kv, G, D], lse [H_kv, G])."""
    logits = torch.einsum("hgd,hmd->hgm", q.float(), keys.float()) * scaling + log_weights.float()
    if valid is not None:
        logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    probs = torch.exp(logits - lse[..., None]).nan_to_num(0.0)
    return torch.einsum("hgm,hmd->hgd", probs, values.float()).to(q.dtype), lse


def _external_attention(
    q: torch.Tensor, external: tuple, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over rows outside the layer's storage, computed where they live (CTKVR's host rows on the
    CPU; rows a method moved to the device there), with its log-sum-exp, returned on q's device."""
    keys, values, valid = _unpack(external)
    if len(external) == 4:
        out, lse = _weighted_attention(q.to(keys.device), keys, values, valid, external[3].to(keys.device), scaling)
        return out.to(q.device), lse.to(q.device)
    every = torch.arange(keys.shape[1], device=keys.device).expand(q.shape[0], q.shape[1], -1)
    out, lse = topk_attention(q.to(keys.device), keys, values, every, scaling, valid, return_lse=True)
    return out.to(q.device), lse.to(q.device)


def attention_recall(q: torch.Tensor, view: HeadView, idx: torch.Tensor, scaling: float) -> torch.Tensor:
    """Top-k attention-mass recall of a selection: the exact attention mass on the selected tokens over the
    mass of the exact top-|selected| tokens, per query head, averaged (1 for Exact-TopK). Over the tokens the
    layer holds at this step, so after an eviction stage it is measured on what survived. A 0-d tensor."""
    logits = exact_logits(q, view.keys) * scaling
    if view.valid is not None:
        logits.masked_fill_(~view.valid[:, None, :], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return mass_recall_tensor(probs, probs.gather(-1, idx).sum(-1), idx.shape[-1])
