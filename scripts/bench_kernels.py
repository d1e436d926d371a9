"""Time the kernels' PyTorch references against their Triton kernels on a CUDA GPU.

    python scripts/bench_kernels.py [--dtype bf16] [--heads 8] [--group 4] [--dim 128]

Prints milliseconds per call, the reference/Triton ratio (> 1: Triton is faster) and the largest absolute
difference from the reference for top-k attention over a uniform cache (with and without the log-sum-exp),
for ragged decode attention, where the padded SDPA call that kvbench.attention makes today is timed too
(its padding copy included, as the decode path pays it every step), for the page summaries and page score
bounds of Quest and HSA, and for SparQ's reduced-dimension scores. Without a GPU it says so and exits 0. A
benchmark, not a test: it checks agreement only loosely (bf16) before timing.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _parts(out: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return out if isinstance(out, tuple) else (out,)


def _time(label: str, impls: dict[str, Callable[..., torch.Tensor | tuple]], args: tuple) -> None:
    """Check every implementation against the first, then print ms per call, first/other ratios and the
    largest absolute difference from the first (over every output, for those that return several)."""
    from triton.testing import do_bench

    outs = {name: _parts(fn(*args)) for name, fn in impls.items()}
    baseline, expected = next(iter(outs.items()))
    errors = {}
    for name, out in outs.items():
        for got, want in zip(out, expected, strict=True):
            torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
        errors[name] = max((got.float() - want.float()).abs().max().item() for got, want in zip(out, expected))
    ms = {name: do_bench(partial(fn, *args), warmup=25, rep=200) for name, fn in impls.items()}
    parts = [f"{name} {t:8.4f} ms" for name, t in ms.items()]
    ratios = [f"{baseline}/{name} {ms[baseline] / t:6.2f}x" for name, t in ms.items() if name != baseline]
    errs = [f"{name} max|err| {errors[name]:.1e}" for name in ms if name != baseline]
    print(f"{label:<36} " + "  ".join(parts) + "  |  " + "  ".join(ratios) + "  |  " + "  ".join(errs))


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
        # valid=None, return_lse=True: what a split selection (merged by lse) pays for the extra output
        _time(f"topk+lse L={length} k={k}", impls, (q, keys, values, idx, dim**-0.5, None, True))


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


def bench_page_minmax(n_kv: int, dim: int, dtype: torch.dtype) -> None:
    from kvbench.kernels.page_summary import page_minmax_reference, page_minmax_triton

    impls = {"reference": page_minmax_reference, "triton": page_minmax_triton}
    # 16 is Quest's page size; N = 131000 leaves a partial last page of 56 rows
    for length, page_size in [(32768, 16), (131072, 16), (131000, 64)]:
        keys = torch.randn(n_kv, length, dim, device="cuda", dtype=dtype)
        _time(f"page_minmax N={length} page={page_size}", impls, (keys, page_size))


def bench_page_scores(n_kv: int, group: int, dim: int, dtype: torch.dtype) -> None:
    from kvbench.kernels.page_summary import page_scores_by_group_scores, page_scores_reference

    impls = {"reference": page_scores_reference, "triton": page_scores_by_group_scores}  # kvbench::group_scores
    for pages in (2048, 8192, 32768):
        q = torch.randn(n_kv, group, dim, device="cuda", dtype=dtype)
        kmin = torch.randn(n_kv, pages, dim, device="cuda", dtype=dtype)
        kmax = kmin + torch.rand(n_kv, pages, dim, device="cuda", dtype=dtype)
        # Quest: every dimension, each query head's own signs
        all_dims = torch.arange(dim, device="cuda").expand(n_kv, dim).contiguous()
        _time(f"page_scores quest P={pages}", impls, (q, kmin, kmax, all_dims, q > 0))
        # HSA: the k1 = D/8 dimensions of largest group |q|, the group's signs ([H, 1, k1])
        dims = q.float().abs().sum(1).topk(dim // 8, dim=-1).indices
        positive = q.float().gather(2, dims[:, None, :].expand(n_kv, group, -1)).sum(1, keepdim=True) > 0
        _time(f"page_scores hsa k1={dim // 8} P={pages}", impls, (q, kmin, kmax, dims, positive))


def bench_reduced_scores(n_kv: int, group: int, dim: int, dtype: torch.dtype) -> None:
    from kvbench.kernels.reduced_scores import reduced_scores_reference, reduced_scores_triton

    impls = {"reference": reduced_scores_reference, "triton": reduced_scores_triton}
    r = dim // 8  # SparQ's compression ratio of 1/8
    for length in (4096, 32768, 131072):
        q = torch.randn(n_kv, group, dim, device="cuda", dtype=dtype)
        keys_t = torch.randn(n_kv, dim, length, device="cuda", dtype=dtype)
        dims = q.float().abs().sum(1).topk(r, dim=-1).indices
        _time(f"reduced_scores N={length} r={r}", impls, (q, keys_t, dims))


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
    bench_page_minmax(args.heads, args.dim, dtype)
    bench_page_scores(args.heads, args.group, args.dim, dtype)
    bench_reduced_scores(args.heads, args.group, args.dim, dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
