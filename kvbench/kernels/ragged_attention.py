"""Decode attention over the flattened ragged KV layout (Ada-KV style, see `kvbench.cache`).

A ragged layer stores keys/values as flat rows `[R, D]`, KV head h's rows at `offsets[h] .. offsets[h] +
len_h`. One decode step attends each query head to its KV head's rows only, without padding the layer to
`[H_kv, max_len, D]`. Rows between one head's segment and the next (append slack) are never read.
The Triton kernel (`ragged_decode_attention_triton`) is what `kvbench.kernels.decode_attention` runs on CUDA;
on CPU that module attends each head's segment itself. Both compute the function documented on the PyTorch
reference (`ragged_decode_attention_reference`), which pads the heads and exists to test the others against.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def ragged_decode_attention_reference(
    q: torch.Tensor,
    keys_flat: torch.Tensor,
    values_flat: torch.Tensor,
    head_offsets: torch.Tensor,
    head_lens: torch.Tensor | Sequence[int],
    scaling: float,
) -> torch.Tensor:
    """Single-token attention of each query head over its KV head's segment of a flat ragged cache (PyTorch).

    q: [H_kv, G, D] (query head h * G + g uses KV head h); keys_flat/values_flat: [N, D]; head_offsets:
    [H_kv] integer tensor of each head's first row; head_lens: H_kv row counts (list or integer tensor).
    out[h, g] = softmax(scaling * q[h, g] . K_h) @ V_h with K_h = keys_flat[offsets[h] : offsets[h] + lens[h]],
    computed in fp32 and returned as [H_kv, G, D] in q's dtype. A head with no rows gets NaN (a softmax over
    nothing); a decode step never has one, since the step's own token is appended before attention.
    """
    _check_shapes(q, keys_flat, values_flat, head_offsets, head_lens)
    lens = torch.as_tensor(head_lens, device=keys_flat.device)
    width = int(lens.max())
    slot = torch.arange(width, device=keys_flat.device)
    valid = slot[None, :] < lens[:, None]  # [H_kv, width]
    # padding slots read some in-range row (the clamp) and are masked out of the softmax
    rows = (head_offsets.to(keys_flat.device)[:, None] + slot[None, :]).clamp(max=keys_flat.shape[0] - 1)
    logits = torch.einsum("hgd,hwd->hgw", q.float(), keys_flat[rows].float()) * scaling
    logits.masked_fill_(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.einsum("hgw,hwd->hgd", probs, values_flat[rows].float()).to(q.dtype)


def ragged_decode_attention_triton(
    q: torch.Tensor,
    keys_flat: torch.Tensor,
    values_flat: torch.Tensor,
    head_offsets: torch.Tensor,
    head_lens: torch.Tensor | Sequence[int],
    scaling: float,
    block_n: int = 64,
    rows_per_split: int = 512,
) -> torch.Tensor:
    """`ragged_decode_attention_reference` as a split-K Triton kernel: for every (KV head, group member), one
    program per `rows_per_split` rows of the longest head, merged by log-sum-exp.

    Each program walks its run of rows `block_n` at a time with an online softmax (fp32 accumulation), so no
    padded copy of the layer is made and a long or skewed head is read by many programs in parallel (one
    program per head made the longest head the step's critical path). Offsets/lengths are not bounds-checked:
    every segment must lie inside keys_flat. Runs on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1.
    """
    _check_shapes(q, keys_flat, values_flat, head_offsets, head_lens)
    # a local import: triton is imported on the first launch, not with kvbench (see _dispatch)
    from kvbench.kernels._triton_kernels import launch_ragged_decode_attention

    # the split count needs the longest head on the host: free for a list (what the cache passes)
    max_len = int(max(head_lens.tolist() if isinstance(head_lens, torch.Tensor) else head_lens, default=0))
    lens = torch.as_tensor(head_lens, dtype=torch.int64, device=q.device)
    offsets = head_offsets.to(device=q.device, dtype=torch.int64)
    return launch_ragged_decode_attention(q, keys_flat, values_flat, offsets, lens, scaling, block_n, max_len,
                                          rows_per_split)


def _check_shapes(
    q: torch.Tensor,
    keys_flat: torch.Tensor,
    values_flat: torch.Tensor,
    head_offsets: torch.Tensor,
    head_lens: torch.Tensor | Sequence[int],
) -> None:
    # shapes only: checking the offsets' values would cost a device sync on every decode step
    if (
        q.dim() != 3
        or keys_flat.dim() != 2
        or keys_flat.shape != values_flat.shape
        or keys_flat.shape[1] != q.shape[2]
        or head_offsets.numel() != q.shape[0]
        or len(head_lens) != q.shape[0]
    ):
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, keys_flat {tuple(keys_flat.shape)}, values_flat "
                         f"{tuple(values_flat.shape)}, {head_offsets.numel()} offsets, {len(head_lens)} lengths")
