"""Split-K (flash-decoding) attention of one query token per head over the static decode layout, on CUDA.

The static layout (`kvbench.cache.static`) keeps each KV head's rows at a fixed capacity with its length on the
device (`fill`), so that a decode step is one graph at every step. Attention written in PyTorch over that
layout (`decode_attention.static_decode_attention`) has to read the whole capacity and mask what is past
`fill`, and inductor's code for it read K/V at a ninth of an H100's bandwidth (docs/journal/gpu.md). This kernel reads only
each head's first `fill[h]` rows, each K/V row once per KV group (the group's query heads are one tensor-core
product), split along the rows so that a long head is read by many programs at once, then merges the splits
by log-sum-exp (the flash-decoding scheme of Dao et al., 2023; FlashInfer's and gpt-fast's decode kernels do
the same). Uniform and ragged layers are the same call: each head's first row comes from `starts`. With an
index tensor (`flash_decode_selected`) the same kernel reads the slots a selection method chose instead of a
head's first rows: the selection methods' attention on the static layout, without gathering the rows first.

It is registered as a PyTorch operator (`kvbench::flash_decode`, with a fake implementation for tracing), so
that the compiled decode step captures it as one node, launched inside the step's CUDA graph; inductor writes
no code for it. Its launch depends only on the buffers' shapes, never on the device lengths. On CPU the PyTorch
reference stays the decode path (the eager CPU path is the exact default); the kernel runs there only in
Triton's interpreter, in the tests.

Why a Triton kernel and not PyTorch's `flex_attention` (which also splits K/V for decoding, takes GQA and a
block mask, and compiles natively): the layout's per-head lengths live in a device tensor that changes at every
step, which a flex block mask can only express by being rebuilt per step (or as a `mask_mod` that still visits
every block of the capacity), and a ragged layer's heads do not start at multiples of one stride. The
measurement against flex_attention, inductor's code and SDPA is `scripts/bench_flash_decode.py` (docs/journal/gpu.md).
"""

from __future__ import annotations

import os

import torch

from kvbench.kernels._dispatch import triton_launchable

BLOCK_N = 64  # rows per block: two [64, 128] bf16 tiles (K and V) per iteration
MIN_SPLIT_ROWS = 256  # a split reads at least this many rows of the capacity (fewer: the merge costs more)
PROGRAMS_PER_SM = 4  # splits are sized so that H_kv x splits fills the GPU this many times over


def flash_decode_applies(keys: torch.Tensor) -> bool:
    """Whether a static layer with these key buffers attends by this kernel: CUDA tensors, triton installed,
    `KVBENCH_KERNELS` not "torch". Decided when the layer enters the static layout, outside any trace; unlike
    the other kernels' dispatch it then holds inside `torch.compile` too (the compiled step captures the
    operator: that is where it is meant to run)."""
    return triton_launchable(keys)


def flash_decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, starts: torch.Tensor,
                 fill: torch.Tensor, scaling: float) -> torch.Tensor:
    """out[h, g] = softmax(scaling * q[h, g] . K_h) V_h with K_h = keys[starts[h] : starts[h] + fill[h]].

    q: [H_kv, G, D]; keys/values: flat row buffers [R, D]; starts, fill: [H_kv] int64 device tensors. Returns
    [H_kv, G, D] in q's dtype. Rows past a head's fill are never read, whatever they hold; a head with fill 0
    gets NaN. The work is split by the buffer's rows per head (R / H_kv), a static shape: no other number
    enters a compiled graph (a ragged layer's longest head, say, would add one graph per value)."""
    return torch.ops.kvbench.flash_decode(q, keys, values, starts, fill, scaling, None)


def flash_decode_selected(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, starts: torch.Tensor,
                          fill: torch.Tensor, idx: torch.Tensor, scaling: float) -> torch.Tensor:
    """Attention of each query head over the slots a selection method chose, on the static layout:
    `sparse_attention.topk_attention_reference(q, view.keys, view.values, idx, scaling, view.valid)` of the
    layer's [H_kv, width] view, without materialising the view or copying the rows out.

    idx: [H_kv, G, k] slots (per query head; a selection shared by the group is the same slots expanded over
    G, stride 0). A shared selection is one program row per KV group (each selected row read once for the
    group's G query heads, as `flash_decode` reads held rows); a per-query-head one is one program row per
    query head. Slots at or past the head's fill get no weight, repeated slots count repeatedly, a query head
    with no live slot gets NaN, as in the reference. The split is sized by k, a static shape."""
    n_kv, group, k = idx.shape
    if group == 1 or idx.stride(1) == 0:
        return torch.ops.kvbench.flash_decode(q, keys, values, starts, fill, scaling, idx[:, 0].long())
    own = torch.ops.kvbench.flash_decode(q.reshape(n_kv * group, 1, q.shape[-1]), keys, values,
                                         starts.repeat_interleave(group), fill.repeat_interleave(group), scaling,
                                         idx.reshape(n_kv * group, k).long())
    return own.view(q.shape)


def split_count(rows_per_head: int, n_kv: int, device: torch.device) -> int:
    """Splits per KV head: enough programs to fill the GPU `PROGRAMS_PER_SM` times over, none reading fewer
    than `MIN_SPLIT_ROWS` of a head's rows. A function of static shapes only."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
    return max(1, min(-(-rows_per_head // MIN_SPLIT_ROWS), -(-PROGRAMS_PER_SM * sms // n_kv)))


@torch.library.custom_op("kvbench::flash_decode", mutates_args=())
def _flash_decode_op(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, starts: torch.Tensor,
                     fill: torch.Tensor, scaling: float, idx: torch.Tensor | None = None) -> torch.Tensor:
    _check(q, keys, values, starts, fill, idx)
    # a local import: triton is imported on the first launch, not with kvbench (see _dispatch)
    from kvbench.kernels._flash_decode_kernels import launch_flash_decode

    rows_per_head = max(1, idx.shape[1] if idx is not None else keys.shape[0] // q.shape[0])
    splits = int(os.environ.get("KVBENCH_FLASH_DECODE_SPLITS", 0)) or split_count(rows_per_head, q.shape[0], q.device)
    return launch_flash_decode(q, keys, values, starts, fill, scaling, rows_per_head, splits, BLOCK_N, idx)


@_flash_decode_op.register_fake
def _(q, keys, values, starts, fill, scaling, idx=None):
    return torch.empty_like(q)


def _check(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, starts: torch.Tensor, fill: torch.Tensor,
           idx: torch.Tensor | None) -> None:
    # shapes and dtypes only: reading the lengths would cost a device sync at every step
    n_kv = q.shape[0]
    ok = (q.dim() == 3 and keys.dim() == 2 and keys.shape == values.shape and keys.shape[1] == q.shape[2]
          and keys.dtype == values.dtype == q.dtype and starts.shape == fill.shape == (n_kv,)
          and starts.dtype == fill.dtype == torch.int64
          and (idx is None or (idx.dim() == 2 and idx.shape[0] == n_kv and idx.dtype == torch.int64)))
    if not ok:
        raise ValueError(f"flash_decode: q {tuple(q.shape)} {q.dtype}, keys {tuple(keys.shape)} {keys.dtype}, "
                         f"values {tuple(values.shape)}, starts {tuple(starts.shape)} {starts.dtype}, fill "
                         f"{tuple(fill.shape)} {fill.dtype}"
                         + ("" if idx is None else f", idx {tuple(idx.shape)} {idx.dtype}"))
