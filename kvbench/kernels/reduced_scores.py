"""Approximate attention logits from a few head dimensions (SparQ's first step).

SparQ keeps a second, transposed copy of the keys (`[H, D, N]`) so that reading r of the D dimensions for
every token is r contiguous rows. `reduced_scores` dispatches between the `kvbench::group_scores` operator
(CUDA, eager and compiled alike) and its PyTorch reference, which documents the semantics.
"""

from __future__ import annotations

import torch

from kvbench.kernels.group_scores import group_scores, group_scores_applies


def reduced_scores(q: torch.Tensor, keys_t: torch.Tensor, dims: torch.Tensor) -> torch.Tensor:
    """`reduced_scores_reference`'s result, computed by the Triton operator where `group_scores_applies`."""
    if group_scores_applies(q, keys_t, dims):
        return group_scores(q, keys_t, dims)
    return reduced_scores_reference(q, keys_t, dims)


def reduced_scores_reference(q: torch.Tensor, keys_t: torch.Tensor, dims: torch.Tensor) -> torch.Tensor:
    """Dot products of the queries with every key over chosen dimensions only (PyTorch).

    q: [H, G, D]; keys_t: [H, D, N] (keys transposed); dims: [H, r] int64 dimensions shared by the group.
    Returns [H, G, N] fp32: out[h, g, n] = sum_j q[h, g, dims[h, j]] * keys_t[h, dims[h, j], n].
    """
    heads, group, _ = q.shape
    r = dims.shape[1]
    q_sel = q.float().gather(2, dims[:, None, :].expand(heads, group, r))  # [H, G, r]
    k_sel = keys_t.gather(1, dims[:, :, None].expand(heads, r, keys_t.shape[2])).float()  # [H, r, N], r rows only
    return torch.bmm(q_sel, k_sel)


def reduced_scores_triton(q: torch.Tensor, keys_t: torch.Tensor, dims: torch.Tensor) -> torch.Tensor:
    """`reduced_scores_reference` by the Triton kernel, launched directly (CUDA, or CPU under TRITON_INTERPRET=1)."""
    from kvbench.kernels._group_scores_kernels import launch_group_scores

    return launch_group_scores(q, keys_t, dims)
