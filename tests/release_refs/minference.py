"""MInference's vertical-and-slash estimate as its release computes it: microsoft/MInference, commit
fb56c917f618e8645f1cfc37535afd7424d78f0d, `minference/modules/minference_forward.py`
(`gather_last_q_vertical_slash_topk_v4.vertical_and_slash_kernel`, the inference path, and
`sum_all_diagonal_matrix`).

One query head at a time (the release's forward loops over heads, K/V repeated): the sizes clamped to
[30, L] and [50, L]; the last min(64, L) queries' logits `q @ k^T / sqrt(D)`, -inf above the last block's
diagonal (`LAST_Q_MASK`), softmax in float32; vertical: the column sums, the first 30 keys +inf, top-k;
slash: the diagonal sums of the padded, strided matrix, `[..., :-last_q + 1]`, the last 100 +inf, top-k, as
offsets `(L - 1) - index`. torch's top-k on those tensors is the release's tie-breaking.
"""

from __future__ import annotations

import math

import torch


def sum_all_diagonal_matrix(mat: torch.Tensor) -> torch.Tensor:
    """The release's diagonal sums of a `[1, 1, n, m]` matrix (one head), via its padded strided view."""
    b, h, n, m = mat.shape
    zero = torch.zeros((b, h, n, n))
    padded = torch.cat((zero, mat, zero), -1)
    strided = padded.as_strided((1, 1, n, n + m), (1, n * (2 * n + m), 2 * n + m + 1, 1))
    return torch.sum(strided, 2)[:, :, 1:]


def vertical_slash(q: torch.Tensor, k: torch.Tensor, vertical_size: int, slash_size: int):
    """q, k `[L, D]` of one query head. Returns (vertical key indices, slash offsets), each in top-k order."""
    q_len, head_dim = q.shape
    vertical_size, slash_size = min(q_len, max(vertical_size, 30)), min(q_len, max(slash_size, 50))
    last_q = min(64, q_len)
    qk = torch.einsum("bhmk, bhnk -> bhmn", q[None, None, -last_q:], k[None, None]) / math.sqrt(head_dim)
    arange = torch.arange(64)
    last_q_mask = (arange[None, None, :, None] >= arange[None, None, None, :])[..., -last_q:, -last_q:]
    qk[:, :, :, -last_q:] = torch.where(last_q_mask, qk[:, :, :, -last_q:], -torch.inf)
    qk = torch.softmax(qk, dim=-1, dtype=torch.float32)
    vertical = qk.sum(-2, keepdim=True)
    vertical[..., :30] = torch.inf
    vertical_topk = torch.topk(vertical, vertical_size, -1).indices
    slash = sum_all_diagonal_matrix(qk)[..., :-last_q + 1]
    slash[..., -100:] = torch.inf
    slash = (q_len - 1) - torch.topk(slash, slash_size, -1).indices
    return vertical_topk.flatten(), slash.flatten()
