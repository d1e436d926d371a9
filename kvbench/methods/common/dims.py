"""Head dimensions chosen by |q| (HSA's k1, SparQ's r) when their number is a runtime input of the static decode
step.

HSA's and SparQ's plans derive how many of the D head dimensions their estimate reads from the length L the plan
was made for (k1 = int(D p / c2), r = round(D t / L)), so a number read as a Python int would make one compiled
graph per prompt length. On a static layer the number is a 0-d device tensor instead (`RuntimeDims`): the step
takes the top `count` dimensions, a number fixed by the loop's capacity W, and zeroes the query on those past the
plan's number, so the estimate sums the plan's terms and exact zeros (in another order than the eager sum: equal
up to float rounding; the compiled steps' tokens are checked against the eager ones).

What it costs: the estimate's products read `count` dimensions where the plan reads its own number, at most
the most of any length whose loop fits W (over half of W, at most W: see `RuntimePage`). For D = 128 at
W = 32K and t = 1,024 that is HSA's 39 against a k1 of 24 to 39, and SparQ's r(W/2), about twice r(W); the
records' traffic stays the plan's (the method's cost model). `scripts/sweep_graphs.py` prints the graphs
saved and the elements read; docs/performance.md weighs them. A kernel that takes the number as a loop bound
would read only the plan's dimensions (GPU work, issue 64)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvbench.kernels.stable_topk import descending_keys, stable_topk_reference


class RuntimeDims:
    """The plan's number of dimensions as a 0-d device tensor (`value`) and the fixed number a step takes
    (`count`): the most of any length in W/2..W, or the plan's own where it is more (a loop outside that rule:
    its own graph)."""

    def __init__(self, value: torch.Tensor, count: int):
        self.value, self.count = value, count

    @classmethod
    def at(cls, planned: int, most: int, device: torch.device) -> "RuntimeDims":
        return cls(torch.tensor(planned, dtype=torch.int64, device=device), max(planned, most))


class Chosen(NamedTuple):
    """What `top_dims` chose: `dims` `[..., m]` in descending order; with a runtime number, `past` `[m]` (the
    positions after the plan's number) and `plan` `[..., D]` (the dimensions that are the plan's); else None."""

    dims: torch.Tensor
    past: torch.Tensor | None = None
    plan: torch.Tensor | None = None


def top_dims(scores: torch.Tensor, planned: int, runtime: RuntimeDims | None, stable: bool = True) -> Chosen:
    """The dimensions of largest `scores` `[..., D]`, in stable descending order (ties to the lower dimension):
    the plan's `planned`, or with `runtime` its fixed `count`, with which of them are past the plan's number.

    Stable, so that the first k of a longer list are the k a shorter one takes: `torch.topk` breaks ties by its
    algorithm, which depends on k, and a bf16 query's |q| sums tie often enough that a compiled HSA step chose
    another dimension than the eager one. By one `topk` of distinct int64 keys (`descending_keys`), not the
    stable top-k operator (a launch more a layer on CUDA), and the plan's dimensions by comparing each key with
    the plan's k-th (elementwise: inductor fuses it into the kernel that reads q, where a scatter or an `any`
    over the chosen was a kernel of its own). `stable=False`: `torch.topk`'s own order, for a release's
    arithmetic op by op (HSA's `scoring_dtype=release`, float16 means that tie often: on the release
    reference's CPU the stable order lowered the overlap of HSA's sets with the release's from 1.000 to 0.984
    at S 4K, t 256); its compiled step may then take another tied dimension than the eager."""
    if runtime is None:
        return Chosen(stable_topk_reference(scores, planned) if stable else scores.topk(planned, dim=-1).indices)
    count = runtime.count
    past = torch.arange(count, device=scores.device) >= runtime.value
    if stable:
        keys = descending_keys(scores)
        values, dims = keys.topk(count, dim=-1)
        last = (runtime.value - 1).clamp(min=0).expand(*values.shape[:-1], 1)  # the plan's k-th
        return Chosen(dims, past, keys >= values.gather(-1, last))
    dims = scores.topk(count, dim=-1).indices
    plan = ((dims[..., None] == torch.arange(scores.shape[-1], device=scores.device)) & ~past[:, None]).any(dim=-2)
    return Chosen(dims, past, plan)


def zero_past(q: torch.Tensor, chosen: Chosen) -> torch.Tensor:
    """`q` `[H, G, D]` with zeros on the dimensions that are not the plan's (with a runtime number): a product
    over the chosen dimensions then sums exact zeros for those past it."""
    if chosen.plan is None:
        return q
    plan = chosen.plan if chosen.plan.dim() == q.dim() else chosen.plan[:, None, :]
    return q.masked_fill(~plan, 0)


def summed(chosen: torch.Tensor, past: torch.Tensor | None) -> torch.Tensor:
    """The sum over the last dimension of `chosen` `[..., m]` (values at the chosen dimensions) of the plan's. With
    a runtime number it sums zeros past the plan's, in another order than the plan's own sum: equal up to float
    rounding. (Accumulating in float64 would make it exact; the stable order alone kept the tiny models' bf16
    tokens equal, so the sum stays the eager path's float32 arithmetic.)"""
    return (chosen if past is None else chosen.masked_fill(past, 0)).sum(-1)
