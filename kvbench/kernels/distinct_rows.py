"""How many distinct rows each KV head's selection reads (a selection method's traffic, `Method.step_traffic`).

The reference marks the selected slots in a zeroed `[H, length]` mask and sums it: three small ATen calls, about
18 us per layer at 8K tokens on two CPU cores. Inductor compiled the same three ops into two OpenMP regions per
layer that mostly wait for the second core: 113-196 us per layer, 3.4 ms of a compiled bf16 Exact-TopK step at
8K (docs/journal/cpu_decode.md). Inside `torch.compile` the count is therefore one opaque op
(`kvbench::distinct_rows`); outside it the op's work is called directly.

On CUDA the op is a Triton kernel (`_distinct_rows_kernels`: a bitmap of the slots set by atomic ORs, each slot
counted by the one index that set its bit), exact like the reference. On an H200 the reference's scatter and
int64 sum took 12 us per layer of Exact-TopK's compiled step (docs/journal/gpu.md section 7): a cost of the harness's
traffic count, not of the method. Not yet run on a GPU; a launch that raises logs one line and the reference
runs from then on (`LaunchFallback`).
"""

from __future__ import annotations

import torch

from kvbench.kernels._dispatch import LaunchFallback, triton_launchable

FALLBACK = LaunchFallback("distinct_rows", "a mask, a scatter and a sum")


def distinct_rows(idx: torch.Tensor, length: int) -> torch.Tensor:
    """Distinct values of each row of `idx` `[H, m]` (int64 slots in `[0, length)`), summed over the rows: a 0-d
    int64 tensor on idx's device."""
    if torch.compiler.is_compiling():
        return _distinct_rows_op(idx, length)
    return _count(idx, length)


def distinct_rows_reference(idx: torch.Tensor, length: int) -> torch.Tensor:
    chosen = torch.zeros(idx.shape[0], length, dtype=torch.bool, device=idx.device)
    return chosen.scatter_(1, idx, True).sum()


def _count(idx: torch.Tensor, length: int) -> torch.Tensor:
    if not triton_launchable(idx):
        return distinct_rows_reference(idx, length)

    def launch():
        from kvbench.kernels._distinct_rows_kernels import launch_distinct_rows  # triton on the first launch

        return launch_distinct_rows(idx, length)

    return FALLBACK.run(launch, lambda: distinct_rows_reference(idx, length))


@torch.library.custom_op("kvbench::distinct_rows", mutates_args=())
def _distinct_rows_op(idx: torch.Tensor, length: int) -> torch.Tensor:
    return _count(idx, length)


@_distinct_rows_op.register_fake
def _(idx: torch.Tensor, length: int) -> torch.Tensor:
    return idx.new_empty(())
