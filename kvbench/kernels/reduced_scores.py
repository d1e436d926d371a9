"""Approximate attention logits from a few head dimensions (SparQ's first step).

SparQ keeps a second, transposed copy of the keys (`[H, D, N]`) so that reading r of the D dimensions for
every token is r contiguous rows. `reduced_scores` dispatches between its Triton kernel (CUDA) and its
PyTorch reference, which documents the semantics.
"""

from __future__ import annotations

import torch

from kvbench.kernels._dispatch import use_triton


def reduced_scores(q: torch.Tensor, keys_t: torch.Tensor, dims: torch.Tensor) -> torch.Tensor:
    """`reduced_scores_reference`'s result, computed by the Triton kernel when `use_triton` allows it."""
    impl = reduced_scores_triton if use_triton(q, keys_t, dims) else reduced_scores_reference
    return impl(q, keys_t, dims)


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
    """`reduced_scores_reference` as a Triton kernel (CUDA, or CPU under TRITON_INTERPRET=1)."""
    from kvbench.kernels._triton_kernels import launch_reduced_scores

    return launch_reduced_scores(q, keys_t, dims)
