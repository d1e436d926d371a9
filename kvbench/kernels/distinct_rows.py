"""How many distinct rows each KV head's selection reads (a selection method's traffic, `Method.step_traffic`).

The count marks the selected slots in a zeroed `[H, length]` mask and sums it: three small ATen calls, about
18 us per layer at 8K tokens on two CPU cores. Inductor compiled the same three ops into two OpenMP regions per
layer that mostly wait for the second core: 113-196 us per layer, 3.4 ms of a compiled bf16 Exact-TopK step at
8K (docs/efficiency/decode_floor.md). Inside `torch.compile` the count is therefore one opaque op
(`kvbench::distinct_rows`) that runs the same ATen calls; outside it they are called directly.
"""

from __future__ import annotations

import torch


def distinct_rows(idx: torch.Tensor, length: int) -> torch.Tensor:
    """Distinct values of each row of `idx` `[H, m]` (int64 slots in `[0, length)`), summed over the rows: a 0-d
    int64 tensor on idx's device."""
    if torch.compiler.is_compiling():
        return _distinct_rows_op(idx, length)
    return _count(idx, length)


def _count(idx: torch.Tensor, length: int) -> torch.Tensor:
    chosen = torch.zeros(idx.shape[0], length, dtype=torch.bool, device=idx.device)
    return chosen.scatter_(1, idx, True).sum()


@torch.library.custom_op("kvbench::distinct_rows", mutates_args=())
def _distinct_rows_op(idx: torch.Tensor, length: int) -> torch.Tensor:
    return _count(idx, length)


@_distinct_rows_op.register_fake
def _(idx: torch.Tensor, length: int) -> torch.Tensor:
    return idx.new_empty(())
