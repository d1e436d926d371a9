"""How many counts the stable top-k's bisection takes before it stops, on rows like the selections' (CPU only).

    python scripts/stable_topk_bisection_counts.py [--rows 50]

`kvbench.kernels._stable_topk_kernels` finds the k-th score's 32 order-preserving bits by bisection, one count
(a reduction over the segment) per step, and stops early at a midpoint with exactly k scores at or above it.
This replays that loop over the kernel's integer keys (`descending_keys`' high half) for random rows of each
kind and prints the mean, min and max number of counts, against the 32 of a loop without the early stop.
"""

from __future__ import annotations

import argparse

import torch

from kvbench.kernels.stable_topk import descending_keys


def counts(scores: torch.Tensor, k: int) -> int:
    """The kernel's bisection over one row of scores, step for step: the number of counts it makes."""
    bits = descending_keys(scores) >> 32
    lo, hi, count, steps = -(2**31), 2**31, -1, 0
    while hi - lo > 1 and count != k:
        mid = lo + ((hi - lo) >> 1)
        count, steps = int((bits >= mid).sum()), steps + 1
        lo, hi = (mid, hi) if count >= k else (lo, mid)
    return steps


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=50)
    args = parser.parse_args(argv)
    gen = torch.Generator().manual_seed(0)
    kinds = {  # name: (a row of scores, k)
        "fp32 logits, 8,192 (a segment), k 1,024": lambda: (3 * torch.randn(8192, generator=gen), 1024),
        "softmax probabilities, 8,192, k 1,024": lambda: (torch.softmax(3 * torch.randn(8192, generator=gen), 0), 1024),
        "a second level's 5 x 1,024 candidates, k 1,024": lambda: (3 * torch.randn(5120, generator=gen), 1024),
        "page bounds, 640 pages, k 10": lambda: (20 * torch.randn(640, generator=gen), 10),
        "bf16 logits, 8,192, k 1,024": lambda: ((3 * torch.randn(8192, generator=gen)).bfloat16(), 1024),
    }
    print(f"{'rows of':48} {'mean':>5} {'min':>4} {'max':>4}   (without the early stop: 32)")
    for name, make in kinds.items():
        steps = [counts(*make()) for _ in range(args.rows)]
        print(f"{name:48} {sum(steps) / len(steps):5.1f} {min(steps):4d} {max(steps):4d}")


if __name__ == "__main__":
    main()
