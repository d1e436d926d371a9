"""The stable top-k of a row of scores: the k highest, ties to the lower index, in that order.

The selection methods pick their rows with it (`kvbench.methods.common.pages`: Quest's and HSA's pages, SparQ's,
RocketKV's and Exact-TopK's tokens). The reference is one `topk` of `descending_keys`: int64 keys, all distinct,
whose descending order is the stable descending order of the scores. On an H100 that int64 `topk` was the
largest single kernel of Quest's selection (docs/journal/gpu.md section 5: 104 us of its compiled step over 8 x 640
pages; the token-level methods run it over rows of 40K-160K slots): PyTorch's radix select passes over the
row once per radix digit of the key, twice as many digits for 64 bits as for 32.

On CUDA the Triton kernel (`_stable_topk_kernels.launch_stable_topk`, whose docstring gives the algorithm: segments
held in registers, the k-th score's bits found by bisection, a long row in levels of candidates) finds the same
indices in the same order: it is integer arithmetic on the scores' bits, exact, not approximate. It is
registered as a PyTorch operator (`kvbench::stable_topk`, with a fake implementation), so that the compiled
decode step captures it as one node, as `kvbench::flash_decode` is. On the CPU the reference runs, inside
`torch.compile` as outside (the CPU's records and graphs are unchanged); the kernel runs there only in Triton's
interpreter, in the tests.

`ordered=False` asks for the same indices in any order that depends only on the scores: the token-level
selections (`methods.common.pages.top_tokens`) attend to a set, and the sort of the k chosen in stable
descending order was a large part of the kernel's time on an H200 (docs/journal/gpu.md section 7). The kernel then returns
them in ascending index order; the reference, which sorts anyway, in its own order, so the CPU path is unchanged.

This kernel has not yet run on a GPU (written in a session without one; `gpu_session.sh selection` checks and
times it; its predecessor, a radix select over histograms, ran on an H100 and an H200). So that a Triton error
on some GPU cannot stop a run, a launch that raises logs one warning line and the reference runs instead, for
that call and every later one in the process: the indices are the same, only the time (and, unordered, their
order) differs.
"""

from __future__ import annotations

import torch

from kvbench.kernels._dispatch import LaunchFallback, triton_launchable

MAX_K = 4096  # the kernel sorts the k chosen keys in one block, and a segment holds 2k; a larger k takes the reference

FALLBACK = LaunchFallback("stable_topk", "PyTorch's int64 topk")


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
    expression, and Triton refuses a constant outside int32 (CPU's C++ takes it). `kvbench.devtools.graph_lint`
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


def stable_topk(scores: torch.Tensor, k: int, ordered: bool = True) -> torch.Tensor:
    """`stable_topk_reference(scores, k)`, by the Triton kernel on CUDA (also inside the compiled step, where it is
    one operator) when k <= `MAX_K`, by the reference otherwise (CPU, `KVBENCH_KERNELS=torch`). Without
    `ordered`, the same indices in an order that depends only on the scores (the kernel's: ascending)."""
    length = scores.shape[-1]
    k = min(k, length)
    if 0 < k <= MAX_K and scores.numel() > 0 and triton_launchable(scores):
        rows = scores.reshape(-1, length)
        return torch.ops.kvbench.stable_topk(rows, k, ordered).view(*scores.shape[:-1], k)
    return stable_topk_reference(scores, k)


@torch.library.custom_op("kvbench::stable_topk", mutates_args=())
def _stable_topk_op(scores: torch.Tensor, k: int, ordered: bool = True) -> torch.Tensor:
    if scores.dim() != 2 or not scores.is_floating_point() or not 0 < k <= min(MAX_K, scores.shape[1]):
        raise ValueError(f"stable_topk: scores {tuple(scores.shape)} {scores.dtype}, k {k}: expected [rows, L] "
                         f"floats and 0 < k <= min({MAX_K}, L)")

    def launch():
        from kvbench.kernels._stable_topk_kernels import launch_stable_topk  # triton on the first launch

        return launch_stable_topk(scores, k, ordered=ordered)

    return FALLBACK.run(launch, lambda: stable_topk_reference(scores, k))


@_stable_topk_op.register_fake
def _(scores, k, ordered=True):
    return scores.new_empty((scores.shape[0], k), dtype=torch.int64)
