"""The stable top-k of a row of scores: the k highest, ties to the lower index, in that order.

The selection methods pick their rows with it (`kvbench.methods.common.pages`: Quest's and HSA's pages, SparQ's,
RocketKV's and Exact-TopK's tokens). The reference is one `topk` of `descending_keys`: int64 keys, all distinct,
whose descending order is the stable descending order of the scores. On an H100 that int64 `topk` was the
largest single kernel of Quest's selection (docs/gpu section 5: 104 us of its compiled step over 8 x 640
pages; the token-level methods run it over rows of 40K-160K slots): PyTorch's radix select passes over the
row once per radix digit of the key, twice as many digits for 64 bits as for 32.

On CUDA the Triton kernel (`_stable_topk_kernels.launch_stable_topk`, whose docstring gives the algorithm: a
radix select over the scores' 32 order-preserving bits, a long row by segments) finds the same indices in the
same order: it is integer arithmetic on the scores' bits, exact, not approximate. It is registered as a PyTorch
operator (`kvbench::stable_topk`, with a fake implementation), so that the compiled decode step captures it as
one node, as `kvbench::flash_decode` is. On the CPU the reference runs, inside `torch.compile` as outside (the
CPU's records and graphs are unchanged); the kernel runs there only in Triton's interpreter, in the tests.

The kernel has not yet run on a GPU (it was written in a session without one; `gpu_session.sh kernel` checks and
times it). So that a Triton error on some GPU cannot stop a run, a launch that raises logs one warning line and
the reference runs instead, for that call and every later one in the process: the indices are the same, only
the time differs.
"""

from __future__ import annotations

import logging

import torch

from kvbench.core.errors import one_line
from kvbench.kernels._dispatch import triton_launchable

MAX_K = 4096  # the kernel sorts the k chosen keys in one block; a larger k takes the reference

log = logging.getLogger("kvbench")
_kernel_failed: list[str] = []  # the first launch error, once a launch has failed in this process


def descending_keys(scores: torch.Tensor) -> torch.Tensor:
    """int64 keys `[..., L]`, all distinct, whose descending order is the stable descending order of `scores`
    (higher score first, ties to the lower index): the score's order-preserving integer image in the high 32
    bits, the index reversed in the low 32 (2^31 - 1 - index: distinct and in [0, 2^31) for any L up to 2^31).
    A `topk` of the keys is then exact and deterministic, which a `topk` of the scores is not on ties, and
    cheaper than the stable sort it replaces (on two CPU cores, 15 us against 190 for the top 23 of 1,366
    pages). Scores are compared as float32 (bf16 and fp16 convert exactly); -0.0 ties with 0.0 as in a float
    sort; NaN sorts first as in a descending sort.

    The reversal starts from 2^31 - 1, not 2^32 - 1 (which orders the keys the same: it only adds 2^31 to every
    low half, with no carry): inductor inlines `C - arange(L)` into a Triton kernel as an int32 index
    expression, and Triton refuses a constant outside int32 (CPU's C++ takes it). `kvbench.engine.graph_lint`
    checks every static method's decode graph for such constants."""
    length = scores.shape[-1]
    bits = (scores.float() + 0.0).view(torch.int32)  # + 0.0 turns -0.0 into 0.0
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats: magnitude bits flipped, so int order = float order
    reversed_index = (1 << 31) - 1 - torch.arange(length, device=scores.device)
    return (ordered.to(torch.int64) << 32) | reversed_index


def stable_topk_reference(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices `[..., k]` (int64) of the k highest of `scores` `[..., L]` along the last dimension, in the order of
    a stable descending sort (ties to the lower index); k is cut to L."""
    return descending_keys(scores).topk(min(k, scores.shape[-1]), dim=-1).indices


def stable_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """`stable_topk_reference(scores, k)`, by the Triton kernel on CUDA (also inside the compiled step, where it is
    one operator) when k <= `MAX_K`, by the reference otherwise (CPU, `KVBENCH_KERNELS=torch`)."""
    length = scores.shape[-1]
    k = min(k, length)
    if 0 < k <= MAX_K and scores.numel() > 0 and triton_launchable(scores):
        rows = scores.reshape(-1, length)
        return torch.ops.kvbench.stable_topk(rows, k).view(*scores.shape[:-1], k)
    return stable_topk_reference(scores, k)


def implementation(device: "torch.device | str") -> str:
    """Which top-k `stable_topk` runs on `device` for k <= `MAX_K`: the Triton operator, or PyTorch's (where the
    operator does not apply, or with the reason its launch failed)."""
    if _kernel_failed:
        return f"PyTorch's int64 topk (the Triton operator failed: {_kernel_failed[0]})"
    launchable = triton_launchable(torch.empty(0, device=device))
    return "the Triton operator (kvbench::stable_topk)" if launchable else "PyTorch's int64 topk"


@torch.library.custom_op("kvbench::stable_topk", mutates_args=())
def _stable_topk_op(scores: torch.Tensor, k: int) -> torch.Tensor:
    if scores.dim() != 2 or not scores.is_floating_point() or not 0 < k <= min(MAX_K, scores.shape[1]):
        raise ValueError(f"stable_topk: scores {tuple(scores.shape)} {scores.dtype}, k {k}: expected [rows, L] "
                         f"floats and 0 < k <= min({MAX_K}, L)")
    if not _kernel_failed:
        try:
            from kvbench.kernels._stable_topk_kernels import launch_stable_topk  # triton on the first launch

            return launch_stable_topk(scores, k)
        except Exception as exc:  # noqa: BLE001 - any Triton or driver error: the reference gives the same indices
            _kernel_failed.append(one_line(exc))
            log.warning("stable_topk: the Triton kernel failed (%s); the PyTorch top-k runs instead", _kernel_failed[0])
    return stable_topk_reference(scores, k)


@_stable_topk_op.register_fake
def _(scores, k):
    return scores.new_empty((scores.shape[0], k), dtype=torch.int64)
