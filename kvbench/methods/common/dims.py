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

import torch

from kvbench.kernels.stable_topk import stable_topk


class RuntimeDims:
    """The plan's number of dimensions as a 0-d device tensor (`value`) and the fixed number a step takes
    (`count`): the most of any length in W/2..W, or the plan's own where it is more (a loop outside that rule:
    its own graph)."""

    def __init__(self, value: torch.Tensor, count: int):
        self.value, self.count = value, count

    @classmethod
    def at(cls, planned: int, most: int, device: torch.device) -> "RuntimeDims":
        return cls(torch.tensor(planned, dtype=torch.int64, device=device), max(planned, most))


def top_dims(scores: torch.Tensor, planned: int, runtime: RuntimeDims | None,
             stable: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The dimensions of largest `scores` `[..., D]`, in stable descending order (ties to the lower dimension)
    `[..., m]`: the plan's m = `planned`, or with `runtime` its fixed `count` and the `[m]` mask of those past
    the plan's number (else None). Stable, so that the first k of a longer list are the k a shorter one takes:
    `torch.topk` breaks ties by its algorithm, which depends on k, and a bf16 query's |q| sums tie often enough
    that a compiled HSA step chose another dimension than the eager one. `stable=False`: `torch.topk`'s own
    order, for a release's arithmetic op by op (HSA's `scoring_dtype=release`, float16 means that tie often: on
    the release reference's CPU the stable order lowered the overlap of HSA's sets with the release's from
    1.000 to 0.984 at S 4K, t 256); its compiled step may then take another tied dimension than the eager."""
    top = (lambda k: stable_topk(scores, k)) if stable else (lambda k: scores.topk(k, dim=-1).indices)
    if runtime is None:
        return top(planned), None
    return top(runtime.count), torch.arange(runtime.count, device=scores.device) >= runtime.value


def zero_past(q: torch.Tensor, dims: torch.Tensor, past: torch.Tensor | None) -> torch.Tensor:
    """`q` `[H, G, D]` with zeros on the chosen dimensions `dims` `[H, m]` that `past` `[m]` marks as not the
    plan's: a product over `dims` then sums exact zeros for them."""
    if past is None:
        return q
    off = torch.zeros(q.shape[0], q.shape[2], dtype=torch.bool, device=q.device).scatter(
        1, dims, past.expand(dims.shape))
    return q.masked_fill(off[:, None, :], 0)


def summed(chosen: torch.Tensor, past: torch.Tensor | None) -> torch.Tensor:
    """The sum over the last dimension of `chosen` `[..., m]` (values at the chosen dimensions) of the plan's, in
    `chosen`'s dtype. Accumulated in float64, so that the zeros past the plan's number do not change its
    rounding: a float32 sum's order follows its length (a sum of 13 values and of the same 13 with 3 zeros
    differ in the last bit for some lengths), which moved a bf16 HSA step's temperature, and a near-tie of its
    tokens, off the eager path's; of at most D values of |q| the float64 sum is exact or nearly so, whatever
    its order."""
    return (chosen if past is None else chosen.masked_fill(past, 0)).double().sum(-1).to(chosen.dtype)
