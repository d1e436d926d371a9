"""Time the decode kernels' PyTorch references against their Triton kernels on a CUDA GPU.

    python scripts/bench_kernels.py [--dtype bf16] [--heads 8] [--group 4] [--dim 128]

Prints milliseconds per call and the reference/Triton ratio (> 1: Triton is faster) for top-k attention
over a uniform cache and for ragged decode attention, where the padded SDPA call that kvbench.attention
makes today is timed too (its padding copy included, as the decode path pays it every step). Without a GPU
it says so and exits 0. A benchmark, not a test: it checks agreement only loosely (bf16) before timing.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _time(label: str, impls: dict[str, Callable[..., torch.Tensor]], args: tuple) -> None:
    """Check every implementation against the first, then print ms per call and first/other ratios."""
    from triton.testing import do_bench

    outs = {name: fn(*args) for name, fn in impls.items()}
    baseline, expected = next(iter(outs.items()))
    for out in outs.values():
        torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)
    ms = {name: do_bench(partial(fn, *args), warmup=25, rep=200) for name, fn in impls.items()}
    parts = [f"{name} {t:8.4f} ms" for name, t in ms.items()]
    ratios = [f"{baseline}/{name} {ms[baseline] / t:6.2f}x" for name, t in ms.items() if name != baseline]
    print(f"{label:<36} " + "  ".join(parts) + "  |  " + "  ".join(ratios))


def bench_topk(n_kv: int, group: int, dim: int, dtype: torch.dtype) -> None:
    from kvbench.kernels.sparse_attention import (
        topk_attention_reference,
        topk_attention_triton,
    )

    impls = {"reference": topk_attention_reference, "triton": topk_attention_triton}
    for length, k in [(4096, 256), (32768, 1024), (131072, 4096)]:
        q = torch.randn(n_kv, group, dim, device="cuda", dtype=dtype)
        keys = torch.randn(n_kv, length, dim, device="cuda", dtype=dtype)
        values = torch.randn(n_kv, length, dim, device="cuda", dtype=dtype)
        idx = torch.randint(0, length, (n_kv, group, k), device="cuda")
        _time(f"topk L={length} k={k}", impls, (q, keys, values, idx, dim**-0.5))


def _padded_sdpa(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    offsets: torch.Tensor,
    lens: list[int],
    scaling: float,
) -> torch.Tensor:
    """What kvbench.attention._decode does on a ragged layer today: KVLayer.head_view's padded copy + SDPA."""
    lens_t = torch.tensor(lens, device=keys.device)
    slot = torch.arange(max(lens), device=keys.device)[None, :]
    valid = slot < lens_t[:, None]
    rows = (offsets[:, None] + slot).clamp(max=keys.shape[0] - 1)
    return F.scaled_dot_product_attention(
        q[None], keys[rows][None], values[rows][None], attn_mask=valid[None, :, None, :], scale=scaling
    )[0]


def bench_ragged(n_kv: int, group: int, dim: int, dtype: torch.dtype) -> None:
    from kvbench.kernels.ragged_attention import (
        ragged_decode_attention_reference,
        ragged_decode_attention_triton,
    )

    impls = {
        "reference": ragged_decode_attention_reference,
        "padded_sdpa": _padded_sdpa,
        "triton": ragged_decode_attention_triton,
    }
    gen = torch.Generator().manual_seed(0)
    for mean_len in (1024, 16384, 65536):
        # Ada-KV-like skew: per-head lengths spread over two orders of magnitude around the mean
        weights = torch.rand(n_kv, generator=gen) ** 4 + 0.01
        lens = (weights / weights.mean() * mean_len).long().clamp(min=1).tolist()
        offsets = (torch.cumsum(torch.tensor(lens), 0) - torch.tensor(lens)).cuda()
        keys = torch.randn(sum(lens), dim, device="cuda", dtype=dtype)
        values = torch.randn(sum(lens), dim, device="cuda", dtype=dtype)
        q = torch.randn(n_kv, group, dim, device="cuda", dtype=dtype)
        _time(f"ragged mean={mean_len} max={max(lens)}", impls, (q, keys, values, offsets, lens, dim**-0.5))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--heads", type=int, default=8, help="KV heads")
    parser.add_argument("--group", type=int, default=4, help="query heads per KV head")
    parser.add_argument("--dim", type=int, default=128)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no GPU: the Triton kernels are benchmarked on CUDA only; nothing to do")
        return 0
    dtype = DTYPES[args.dtype]
    print(f"{torch.cuda.get_device_name()}  H_kv={args.heads} G={args.group} D={args.dim} {args.dtype}")
    bench_topk(args.heads, args.group, args.dim, dtype)
    bench_ragged(args.heads, args.group, args.dim, dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
