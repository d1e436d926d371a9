"""Exact attention logits of each query head against every key of its KV head, in float32 (Exact-TopK's ranking,
the top-k recall metric).

On CUDA (eager and compiled alike) the `kvbench::group_scores` operator computes them, reading each key once
per KV group as one tensor-core product (docs/journal/gpu.md section 7: inductor's reduction below ran at 3.6x the time of
reading the keys once on an H200). On the CPU the reference is one batched product over keys converted to
float32; inside `torch.compile` (the compiled decode step) it is one reduction per query head of the group,
which inductor compiles into a kernel that reads the keys in their own dtype: the product, at 3 query heads x
8K keys x 64 dimensions per KV head, runs at a fifth of the memory's rate on two CPU cores (MKL's small-M case)
and, in bfloat16, after a float32 copy of every key; the reductions took 190 us (fp32) / 250 us (bf16) per
layer against 370-440 for the compiled product in a 30-layer micro-benchmark (docs/journal/cpu_decode.md). The products are exact in float32 either way
(bf16 x bf16 fits a float32 mantissa); only the order of the sums differs.
"""

from __future__ import annotations

import torch

from kvbench.kernels.fusion import realized
from kvbench.kernels.group_scores import group_scores, group_scores_applies


def exact_logits(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q `[H, G, D]`, keys `[H, L, D]` -> `[H, G, L]` float32: out[h, g, l] = q[h, g] . keys[h, l] (unscaled)."""
    if group_scores_applies(q, keys):
        return group_scores(q, keys.transpose(1, 2))
    if torch.compiler.is_compiling():
        q = realized(q)  # the query's rotary embedding computed once, not once per key (kernels.fusion)
        return torch.stack([(q[:, g, None, :].float() * keys.float()).sum(-1) for g in range(q.shape[1])], dim=1)
    return torch.einsum("hgd,hld->hgl", q.float(), keys.float())
