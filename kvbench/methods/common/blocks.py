"""Pieces ShadowKV and InfLLM share: the model's RoPE applied to and removed from cached keys (both keep
pre-RoPE keys and re-rotate them at the positions a decode step needs), and the check that the model has one.

`Step.rotary` maps logical positions `[N]` to `(cos, sin)` `[N, D]` in fp32 (the model's RoPE scaling and
attention factor included). RoPE is `x * cos + rotate_half(x) * sin`, a rotation of each pair of dimensions
scaled by `cos^2 + sin^2` (1 unless the model's RoPE has an attention factor), so its inverse is
`(x * cos - rotate_half(x) * sin) / (cos^2 + sin^2)`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Rotary = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """transformers' Llama `rotate_half`: (x1, x2) -> (-x2, x1) over the two halves of the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def _cos_sin(rotary: Rotary, positions: torch.Tensor, shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin for `positions` (any shape broadcastable to `shape[:-1]`), shaped to broadcast over `shape`;
    the rotary runs once per distinct position (heads share positions; a re-rotation target is one)."""
    distinct, inverse = torch.unique(positions.reshape(-1), return_inverse=True)
    cos, sin = rotary(distinct)
    out = (*positions.shape, shape[-1])
    return cos[inverse].reshape(out), sin[inverse].reshape(out)


def rope(x: torch.Tensor, positions: torch.Tensor, rotary: Rotary) -> torch.Tensor:
    """Pre-RoPE vectors `x` [..., N, D] rotated to `positions` (broadcastable to [..., N]); fp32."""
    cos, sin = _cos_sin(rotary, positions, x.shape)
    x = x.float()
    return x * cos + rotate_half(x) * sin


def unrope(x: torch.Tensor, positions: torch.Tensor, rotary: Rotary) -> torch.Tensor:
    """Post-RoPE vectors `x` [..., N, D] at `positions` back to pre-RoPE (the exact inverse of `rope`); fp32."""
    cos, sin = _cos_sin(rotary, positions, x.shape)
    x = x.float()
    return (x * cos - rotate_half(x) * sin) / (cos * cos + sin * sin)


def needs_rotary(rotary: Rotary | None, what: str) -> Rotary:
    """The step's rotary embedding, or one clear error naming what needs it."""
    if rotary is None:
        raise ValueError(f"{what} works on pre-RoPE keys, and this model has no rotary embedding (Step.rotary is "
                         "None)")
    return rotary
