"""Approximate attention logits from a few head dimensions (SparQ's first step).

SparQ keeps a second, transposed copy of the keys (`[H, D, N]`) so that reading r of the D dimensions for
every token is r contiguous rows. `reduced_scores` dispatches between the `kvbench::group_scores` operator
(CUDA, eager and compiled alike) and its PyTorch reference (`group_scores.group_scores_reference`, with
`dims`), which documents the semantics.
"""

from __future__ import annotations

import torch

from kvbench.kernels.group_scores import group_scores, group_scores_applies
from kvbench.kernels.group_scores import group_scores_reference as reduced_scores_reference


def reduced_scores(q: torch.Tensor, keys_t: torch.Tensor, dims: torch.Tensor) -> torch.Tensor:
    """`reduced_scores_reference`'s result, computed by the Triton operator where `group_scores_applies`."""
    if group_scores_applies(q, keys_t, dims):
        return group_scores(q, keys_t, dims)
    return reduced_scores_reference(q, keys_t, dims)


def reduced_scores_triton(q: torch.Tensor, keys_t: torch.Tensor, dims: torch.Tensor) -> torch.Tensor:
    """`reduced_scores_reference` by the Triton kernel, launched directly (CUDA, or CPU under TRITON_INTERPRET=1)."""
    from kvbench.kernels._group_scores_kernels import launch_group_scores

    return launch_group_scores(q, keys_t, dims)
