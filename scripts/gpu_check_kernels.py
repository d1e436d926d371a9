"""Check every Triton kernel, compiled on a CUDA GPU, against its PyTorch reference.

    python scripts/gpu_check_kernels.py                  # fp16, bf16 and fp32, the whole grid
    python scripts/gpu_check_kernels.py --dtypes bf16 --quick
    TRITON_INTERPRET=1 python scripts/gpu_check_kernels.py --device cpu --tiny   # this script's CPU smoke test

`tests/test_kernels.py` runs the same kernels in Triton's interpreter on CPU (and, with
KVBENCH_KERNEL_DEVICE=cuda TRITON_INTERPRET=0, compiled on a GPU at the tests' small shapes); this script
runs the compiled kernels at decode-sized shapes: head dims 64 and 128, GQA groups 1, 4 and 8, lengths that
are not multiples of the kernels' blocks, ragged per-head lengths with empty heads and slack rows between
heads, top-k selections with k >= L, padding masks, and strided inputs. Each case is compared with the
PyTorch reference (`kvbench.kernels.*_reference`) evaluated in fp32 on the same inputs widened to fp32
(fp16/bf16 widen exactly), with these tolerances:

- attention outputs (top-k, ragged): atol 1e-5 plus rtol = the output dtype's unit roundoff (2^-8 bf16,
  2^-11 fp16; a compiled kernel rounds its fp32 result to nearest) + 1e-5 for the fp32 accumulation; the
  log-sum-exp (fp32): atol 1e-5, rtol 1e-5;
- page min/max: bitwise equal (a min or a max is one of its inputs);
- page score bounds and reduced-dimension scores (fp32 sums of n products in another order than the
  reference's GEMM): |ours - ref| <= 2 (n + 1) 2^-24 sum|products| + 1e-6, the classic bound on two fp32
  sums' rounding errors, with sum|products| computed by the reference on |inputs|.

A head or query head over nothing (an empty ragged head, a selection that is all padding) must be NaN in
both. Prints one line per case and a summary table, and exits 1 if any case fails (or crashes). Without
CUDA it prints one line and exits 0. `--tiny`: one head dim and group, a few small cases per kernel (empty heads,
slack rows, padding and k > L kept), no strided or dispatcher case: what the interpreter runs in seconds
(`tests/test_gpu_scripts.py`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
UNIT_ROUNDOFF = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 0.0}
ATOL = 1e-5
ACC_RTOL = 1e-5  # fp32 accumulation in the kernel and in the reference
U32 = 2.0**-24
DEVICE = "cuda"  # "cpu" with --device cpu: the same grid in Triton's interpreter (slow; to check this script)
GRIDS = ("full", "quick", "tiny")


@dataclass
class Result:
    kernel: str
    dtype: str
    case: str
    ok: bool
    worst: float  # largest |err| / tolerance over the compared elements (<= 1 passes); 0 for exact checks
    max_abs: float
    note: str = ""


RESULTS: list[Result] = []


def _ratio(got: torch.Tensor, want: torch.Tensor, tol: torch.Tensor) -> tuple[bool, float, float, str]:
    """Compare got with want elementwise under tol; NaN must sit where want has NaN. (ok, worst, max_abs, note)"""
    got, want = got.double(), want.double()
    tol = torch.as_tensor(tol, dtype=torch.float64, device=got.device).expand_as(want)
    nan_got, nan_want = got.isnan(), want.isnan()
    if not torch.equal(nan_got, nan_want):
        return False, float("inf"), float("inf"), f"NaN pattern differs ({int(nan_got.sum())} vs {int(nan_want.sum())})"
    live = ~nan_want
    if not live.any():
        return True, 0.0, 0.0, "all NaN in both"
    err = (got[live] - want[live]).abs()
    if not torch.isfinite(err).all():
        return False, float("inf"), float("inf"), "non-finite output"
    worst = float((err / tol[live]).max())
    note = f"{int(nan_want.sum())} NaN values in both" if nan_want.any() else ""
    return worst <= 1.0, worst, float(err.max()), note


def _attention_tol(exact: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # the interpreter truncates fp32 -> bf16 casts (a whole ulp; compiled kernels round to nearest: half of one)
    rounding = UNIT_ROUNDOFF[dtype] * (2 if DEVICE == "cpu" and dtype == torch.bfloat16 else 1)
    return ATOL + (rounding + ACC_RTOL) * exact.abs().nan_to_num(0.0)


def _record(kernel: str, dtype: torch.dtype, case: str, checks: list[tuple[str, tuple]]) -> None:
    ok = all(c[1][0] for c in checks)
    worst = max(c[1][1] for c in checks)
    max_abs = max(c[1][2] for c in checks)
    notes = "; ".join(f"{name}: {c[3]}" if name else c[3] for name, c in checks if c[3])
    name = {v: k for k, v in DTYPES.items()}[dtype]
    RESULTS.append(Result(kernel, name, case, ok, worst, max_abs, notes))
    print(f"{'PASS' if ok else 'FAIL'}  {kernel:<15} {name:<5} {case:<58} err/tol {worst:7.3f}  "
          f"max|err| {max_abs:.2e}  {notes}", flush=True)


def _run(kernel: str, dtype: torch.dtype, case: str, fn: Callable[[], list[tuple[str, tuple]]]) -> None:
    try:
        checks = fn()
    except Exception as exc:  # noqa: BLE001 - a crash is a failed case, reported with its cause
        name = {v: k for k, v in DTYPES.items()}[dtype]
        RESULTS.append(Result(kernel, name, case, False, float("inf"), float("inf"), f"{type(exc).__name__}: {exc}"))
        print(f"FAIL  {kernel:<15} {name:<5} {case:<58} CRASH {type(exc).__name__}: {exc}", flush=True)
        traceback.print_exc()
        return
    _record(kernel, dtype, case, checks)


def _randn(gen: torch.Generator, *shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, device=DEVICE).to(dtype)


# -- top-k attention ------------------------------------------------------------------------------------


def _dims_groups(grid: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return ((64,), (4,)) if grid == "tiny" else ((64, 128), (1, 4, 8))


def check_topk(dtype: torch.dtype, grid: str) -> None:
    from kvbench.kernels.sparse_attention import topk_attention, topk_attention_reference, topk_attention_triton

    n_kv = 4
    # (L, k, selection): random indices repeat (they count repeatedly); "perm" selects distinct tokens
    shapes = [(1, 1, "rand"), (37, 64, "rand"), (300, 37, "rand"), (4099, 64, "rand"), (4099, 65, "perm"),
              (4099, 4099, "perm"), (32771, 2048, "rand")]
    if grid == "quick":
        shapes = shapes[1:4]
    elif grid == "tiny":
        shapes = [(37, 16, "rand"), (40, 40, "perm")]
    dims, groups = _dims_groups(grid)
    for dim in dims:
        for group in groups:
            for length, k, kind in shapes:
                for masked in (False, True):
                    if masked and length < 37:
                        continue
                    case = f"D={dim} G={group} L={length} k={k} {kind}{' masked' if masked else ''}"
                    _run("topk_attention", dtype, case,
                         lambda: _topk_case(dtype, n_kv, group, length, dim, k, kind, masked,
                                            topk_attention, topk_attention_reference, topk_attention_triton))
    # strided inputs: keys/values as column slices of wider rows, q transposed
    if grid != "tiny":
        _run("topk_attention", dtype, "strided D=128 G=4 L=1000 k=100", lambda: _topk_strided(dtype))


def _topk_case(dtype, n_kv, group, length, dim, k, kind, masked, dispatch, reference, triton_fn):
    gen = torch.Generator(device=DEVICE).manual_seed(length * 31 + k * 7 + dim + group)
    q = _randn(gen, n_kv, group, dim, dtype=dtype)
    keys = _randn(gen, n_kv, length, dim, dtype=dtype)
    values = _randn(gen, n_kv, length, dim, dtype=dtype)
    if kind == "perm":
        idx = torch.stack([torch.randperm(length, generator=gen, device=DEVICE)[:k] for _ in range(n_kv * group)])
        idx = idx.view(n_kv, group, k)
    else:
        idx = torch.randint(0, length, (n_kv, group, k), generator=gen, device=DEVICE)
    valid = None
    if masked:
        # ragged-like padding: head h keeps its first lens[h] slots; head 3 keeps none, so its selections
        # are all padding (NaN out, -inf lse in both)
        lens = torch.tensor([length, length // 2, max(1, length // 7), 0], device=DEVICE)
        valid = torch.arange(length, device=DEVICE)[None, :] < lens[:, None]
        # padding slots hold huge values: weight leaking onto them would show
        keys = torch.where(valid[..., None], keys, torch.full_like(keys, 1e4))
        values = torch.where(valid[..., None], values, torch.full_like(values, 1e4))
        # heads 1 and 2: every query head selects at least one real token
        idx[1:3, :, 0] = 0
    scaling = dim**-0.5
    out, lse = triton_fn(q, keys, values, idx, scaling, valid, return_lse=True)
    exact, exact_lse = reference(q.float(), keys.float(), values.float(), idx, scaling, valid, return_lse=True)
    ref = reference(q, keys, values, idx, scaling, valid)
    checks = [
        ("out", _ratio(out.float(), exact, _attention_tol(exact, dtype))),
        ("lse", _lse_check(lse, exact_lse)),
        ("reference", _ratio(ref.float(), exact, _attention_tol(exact, dtype))),
    ]
    if DEVICE == "cuda":  # the dispatcher picks the kernel on CUDA tensors and returns its result
        checks.append(("dispatch", _same(dispatch(q, keys, values, idx, scaling, valid), out)))
    return checks


def _lse_check(lse: torch.Tensor, exact: torch.Tensor) -> tuple[bool, float, float, str]:
    """fp32 log-sum-exp: -inf (a selection of nothing) exactly where the reference has it, else close."""
    if lse.dtype != torch.float32 or not torch.equal(lse == float("-inf"), exact == float("-inf")):
        return False, float("inf"), float("inf"), f"{lse.dtype}, or -inf pattern differs"
    live = exact != float("-inf")
    if not live.any():
        return True, 0.0, 0.0, "all -inf in both"
    return _ratio(lse[live], exact[live], ATOL + 1e-5 * exact[live].abs())


def _same(got: torch.Tensor, want: torch.Tensor) -> tuple[bool, float, float, str]:
    """Bitwise equal (NaN where the other has NaN): the dispatcher ran the kernel."""
    same = torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0))
    return same, 0.0 if same else float("inf"), 0.0, "" if same else "dispatcher result differs from the kernel's"


def _impl(dispatch: Callable, triton_fn: Callable) -> Callable:
    """The dispatcher on CUDA (which must pick the kernel there), the kernel itself under the interpreter."""
    return dispatch if DEVICE == "cuda" else triton_fn


def _topk_strided(dtype):
    from kvbench.kernels.sparse_attention import topk_attention_reference, topk_attention_triton

    gen = torch.Generator(device=DEVICE).manual_seed(2)
    wide = _randn(gen, 2, 1000, 384, dtype=dtype)
    keys, values = wide[..., :128], wide[..., 256:]
    q = _randn(gen, 4, 2, 128, dtype=dtype).transpose(0, 1)
    idx = torch.randint(0, 1000, (2, 4, 100), generator=gen, device=DEVICE)
    out = topk_attention_triton(q, keys, values, idx, 128**-0.5)
    exact = topk_attention_reference(q.float(), keys.float(), values.float(), idx, 128**-0.5)
    return [("", _ratio(out.float(), exact, _attention_tol(exact, dtype)))]


# -- ragged decode attention ----------------------------------------------------------------------------


def check_ragged(dtype: torch.dtype, grid: str) -> None:
    from kvbench.kernels.decode_attention import decode_attention

    layouts = [
        ("lens 1..20000, one empty", [1, 63, 64, 65, 0, 4097, 1000, 20000], 0),
        ("same, slack 7 rows between heads", [1, 63, 64, 65, 0, 4097, 1000, 20000], 7),
        ("skewed, two empty", [0, 5, 131, 0, 1, 8191, 2, 300], 3),
    ]
    if grid == "quick":
        layouts = layouts[1:2]
    elif grid == "tiny":
        layouts = [("lens 1..40, one empty", [1, 0, 17, 40], 0), ("same, slack 3 rows between heads", [1, 0, 17, 40], 3)]
    dims, groups = _dims_groups(grid)
    for dim in dims:
        for group in groups:
            for name, lens, gap in layouts:
                case = f"D={dim} G={group} {name}"
                _run("ragged_decode", dtype, case, lambda: _ragged_case(dtype, lens, group, dim, gap))
    if grid != "tiny":
        _run("ragged_decode", dtype, "dispatcher D=128 G=4",
             lambda: _ragged_dispatch(dtype, decode_attention))


def _ragged_inputs(dtype, lens, group, dim, gap, seed):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    lens_t = torch.tensor(lens)
    offsets = (torch.cumsum(lens_t + gap, 0) - lens_t).to(DEVICE)  # gap junk rows before every head
    total = int(lens_t.sum()) + gap * len(lens)
    q = _randn(gen, len(lens), group, dim, dtype=dtype)
    keys = _randn(gen, total, dim, dtype=dtype)
    values = _randn(gen, total, dim, dtype=dtype)
    if gap:  # junk rows hold NaN: a kernel that reads one turns its head's output to NaN
        junk = torch.ones(total, dtype=torch.bool, device=DEVICE)
        for start, n in zip(offsets.tolist(), lens):
            junk[start:start + n] = False
        keys[junk] = float("nan")
        values[junk] = float("nan")
    return q, keys, values, offsets


def _ragged_exact(q, keys, values, offsets, lens, scaling):
    """Oracle: each head's own rows sliced out, a plain fp64 softmax (NaN for an empty head)."""
    outs = []
    for h, (start, n) in enumerate(zip(offsets.tolist(), lens)):
        k, v = keys[start:start + n].double(), values[start:start + n].double()
        outs.append(torch.softmax(q[h].double() @ k.T * scaling, -1) @ v if n else
                    torch.full(q[h].shape, float("nan"), dtype=torch.float64, device=q.device))
    return torch.stack(outs)


def _ragged_case(dtype, lens, group, dim, gap):
    from kvbench.kernels.ragged_attention import ragged_decode_attention_reference, ragged_decode_attention_triton

    q, keys, values, offsets = _ragged_inputs(dtype, lens, group, dim, gap, sum(lens) + dim + group + gap)
    scaling = dim**-0.5
    out = ragged_decode_attention_triton(q, keys, values, offsets, lens, scaling)
    exact = _ragged_exact(q, keys, values, offsets, lens, scaling)
    checks = [("vs fp64", _ratio(out.float(), exact, _attention_tol(exact, dtype)))]
    if not gap:  # the padded reference reads (and masks) rows past a head: only without NaN junk rows
        ref32 = ragged_decode_attention_reference(q.float(), keys.float(), values.float(), offsets, lens, scaling)
        checks.append(("vs reference", _ratio(out.float(), ref32, _attention_tol(ref32, dtype))))
    # lengths as a tensor on the device, as the cache passes them
    again = ragged_decode_attention_triton(q, keys, values, offsets, torch.tensor(lens, device=DEVICE), scaling)
    checks.append(("tensor lens", _same(again, out)))
    return checks


def _ragged_dispatch(dtype, dispatch):
    from kvbench.kernels.ragged_attention import ragged_decode_attention_triton

    lens = [7, 1, 4000, 129]
    q, keys, values, offsets = _ragged_inputs(dtype, lens, 4, 128, 5, 99)
    out = ragged_decode_attention_triton(q, keys, values, offsets, lens, 0.1)
    exact = _ragged_exact(q, keys, values, offsets, lens, 0.1)
    checks = [("", _ratio(out.float(), exact, _attention_tol(exact, dtype)))]
    if DEVICE == "cuda":
        starts = offsets.tolist()
        caps = [min(n, keys.shape[0] - s) for s, n in zip(starts, lens)]
        checks.append(("dispatch", _same(dispatch(q, keys, values, 0.1, starts, lens, caps), out)))
    return checks


# -- page summaries -------------------------------------------------------------------------------------


def check_page_minmax(dtype: torch.dtype, grid: str) -> None:
    cases = [(1, 16), (15, 16), (16, 16), (17, 16), (4099, 16), (37, 1), (100, 3), (1000, 40), (131000, 64)]
    if grid == "quick":
        cases = [(17, 16), (1000, 40)]
    elif grid == "tiny":
        cases = [(17, 16), (37, 5)]
    for dim in _dims_groups(grid)[0]:
        for n, page in cases:
            _run("page_minmax", dtype, f"D={dim} N={n} page={page}", lambda: _minmax_case(dtype, 8, n, dim, page))
    if grid != "tiny":
        _run("page_minmax", dtype, "strided (transposed [H, D, N]) N=4099 page=16", lambda: _minmax_strided(dtype))


def _minmax_case(dtype, heads, n, dim, page):
    from kvbench.kernels.page_summary import page_minmax, page_minmax_reference, page_minmax_triton

    gen = torch.Generator(device=DEVICE).manual_seed(n * 100 + page + dim)
    keys = _randn(gen, heads, n, dim, dtype=dtype)
    got, want = _impl(page_minmax, page_minmax_triton)(keys, page), page_minmax_reference(keys, page)
    return [(name, _exact(g, w)) for name, g, w in zip(("min", "max"), got, want)]


def _minmax_strided(dtype):
    from kvbench.kernels.page_summary import page_minmax_reference, page_minmax_triton

    gen = torch.Generator(device=DEVICE).manual_seed(10)
    keys = _randn(gen, 4, 128, 4099, dtype=dtype).transpose(1, 2)
    got, want = page_minmax_triton(keys, 16), page_minmax_reference(keys.contiguous(), 16)
    return [(name, _exact(g, w)) for name, g, w in zip(("min", "max"), got, want)]


def _exact(got: torch.Tensor, want: torch.Tensor) -> tuple[bool, float, float, str]:
    if got.shape != want.shape or got.dtype != want.dtype:
        return False, float("inf"), float("inf"), f"{tuple(got.shape)} {got.dtype} vs {tuple(want.shape)} {want.dtype}"
    same = torch.equal(got, want)
    max_abs = float((got.float() - want.float()).abs().max()) if got.numel() else 0.0
    return same, 0.0 if same else float("inf"), max_abs, "" if same else "not bitwise equal"


def _sum_bound(n_terms: int, abs_sum: torch.Tensor) -> torch.Tensor:
    return 2 * (n_terms + 1) * U32 * abs_sum + 1e-6


def check_page_scores(dtype: torch.dtype, grid: str) -> None:
    pages_list = {"full": (1, 7, 257, 8193), "quick": (257,), "tiny": (7,)}[grid]
    dims, groups = _dims_groups(grid)
    for dim in dims:
        for group in groups:
            for mode in ("quest", "hsa"):
                for pages in pages_list:
                    _run("page_scores", dtype, f"D={dim} G={group} {mode} P={pages}",
                         lambda: _scores_case(dtype, 8, group, dim, pages, mode))
    if grid != "tiny":
        _run("page_scores", dtype, "strided summaries, expanded signs D=128 G=4 P=300",
             lambda: _scores_strided(dtype))


def _scores_inputs(dtype, heads, group, dim, pages, mode, gen):
    from kvbench.kernels.page_summary import page_minmax_reference

    q = _randn(gen, heads, group, dim, dtype=dtype)
    kmin, kmax = page_minmax_reference(_randn(gen, heads, pages * 16, dim, dtype=dtype), 16)
    if mode == "quest":  # every dimension (in random order), each query head's own signs
        dims = torch.stack([torch.randperm(dim, generator=gen, device=DEVICE) for _ in range(heads)])
        positive = q.float().gather(2, dims[:, None, :].expand(heads, group, dim)) > 0
    else:  # HSA: the D/8 dimensions of largest group |q|, the group's signs ([H, 1, k1])
        dims = q.float().abs().sum(1).topk(dim // 8, dim=-1).indices
        positive = q.float().gather(2, dims[:, None, :].expand(heads, group, -1)).sum(1, keepdim=True) > 0
    return q, kmin, kmax, dims, positive


def _scores_case(dtype, heads, group, dim, pages, mode):
    from kvbench.kernels.page_summary import page_scores, page_scores_by_group_scores, page_scores_reference

    gen = torch.Generator(device=DEVICE).manual_seed(pages * 10 + group + dim)
    q, kmin, kmax, dims, positive = _scores_inputs(dtype, heads, group, dim, pages, mode, gen)
    got = _impl(page_scores, page_scores_by_group_scores)(q, kmin, kmax, dims, positive)
    want = page_scores_reference(q, kmin, kmax, dims, positive)
    abs_sum = page_scores_reference(q.abs(), kmin.abs(), kmax.abs(), dims, positive)
    return [("", _ratio(got, want, _sum_bound(dims.shape[1], abs_sum)))]


def _scores_strided(dtype):
    from kvbench.kernels.page_summary import page_scores_by_group_scores, page_scores_reference

    gen = torch.Generator(device=DEVICE).manual_seed(11)
    wide = _randn(gen, 2, 300, 300, dtype=dtype)
    kmin, kmax = wide[..., :128], wide[..., 150:278]  # [H, P, D] views with row stride 300
    q = _randn(gen, 4, 2, 128, dtype=dtype).transpose(0, 1)
    dims = torch.stack([torch.randperm(128, generator=gen, device=DEVICE)[:16] for _ in range(2)])  # one sign a dim
    positive = (torch.rand(2, 1, 16, generator=gen, device=DEVICE) > 0.5).expand(2, 4, 16)
    got = page_scores_by_group_scores(q, kmin, kmax, dims, positive)
    want = page_scores_reference(q, kmin, kmax, dims, positive)
    abs_sum = page_scores_reference(q.abs(), kmin.abs(), kmax.abs(), dims, positive)
    return [("", _ratio(got, want, _sum_bound(16, abs_sum)))]


# -- reduced-dimension scores ---------------------------------------------------------------------------


def check_reduced_scores(dtype: torch.dtype, grid: str) -> None:
    lengths = {"full": (1, 127, 129, 4099, 32771), "quick": (129,), "tiny": (1, 37)}[grid]
    dims, groups = _dims_groups(grid)
    for dim in dims:
        for group in groups:
            for n in lengths:
                for r in ((1, dim // 8, dim) if n == 4099 else (dim // 8,)):
                    _run("reduced_scores", dtype, f"D={dim} G={group} N={n} r={r}",
                         lambda: _reduced_case(dtype, 8, group, dim, n, r))
    if grid != "tiny":
        _run("reduced_scores", dtype, "strided keys_t, repeated dims D=128 G=4 N=999",
             lambda: _reduced_strided(dtype))


def _reduced_case(dtype, heads, group, dim, n, r):
    from kvbench.kernels.reduced_scores import reduced_scores, reduced_scores_reference, reduced_scores_triton

    gen = torch.Generator(device=DEVICE).manual_seed(n + r + group + dim)
    q = _randn(gen, heads, group, dim, dtype=dtype)
    keys_t = _randn(gen, heads, dim, n, dtype=dtype)
    dims = torch.stack([torch.randperm(dim, generator=gen, device=DEVICE)[:r] for _ in range(heads)])
    got = _impl(reduced_scores, reduced_scores_triton)(q, keys_t, dims)
    want = reduced_scores_reference(q, keys_t, dims)
    abs_sum = reduced_scores_reference(q.abs(), keys_t.abs(), dims)
    return [("", _ratio(got, want, _sum_bound(r, abs_sum)))]


def _reduced_strided(dtype):
    from kvbench.kernels.reduced_scores import reduced_scores_reference, reduced_scores_triton

    gen = torch.Generator(device=DEVICE).manual_seed(13)
    keys_t = _randn(gen, 2, 999, 128, dtype=dtype).transpose(1, 2)  # [H, D, N], N not contiguous
    q = _randn(gen, 4, 2, 128, dtype=dtype).transpose(0, 1)
    dims = torch.randint(0, 128, (2, 16), generator=gen, device=DEVICE)  # repeats count twice
    got = reduced_scores_triton(q, keys_t, dims)
    want = reduced_scores_reference(q, keys_t, dims)
    abs_sum = reduced_scores_reference(q.abs(), keys_t.abs(), dims)
    return [("", _ratio(got, want, _sum_bound(16, abs_sum)))]


def check_exact_logits(dtype: torch.dtype, grid: str) -> None:
    """The group-scores operator over every dimension (Exact-TopK's logits), keys as the static layout holds them:
    [H, L, D] rows of a flat buffer, transposed by a view."""
    lengths = {"full": (1, 127, 129, 4099, 32771), "quick": (129,), "tiny": (1, 37)}[grid]
    dims, groups = _dims_groups(grid)
    for dim in dims:
        for group in groups:
            for n in lengths:
                _run("exact_logits", dtype, f"D={dim} G={group} N={n}", lambda: _exact_case(dtype, 8, group, dim, n))


def _exact_case(dtype, heads, group, dim, n):
    from kvbench.kernels._group_scores_kernels import launch_group_scores

    gen = torch.Generator(device=DEVICE).manual_seed(n + group + dim)
    q = _randn(gen, heads, group, dim, dtype=dtype)
    keys = _randn(gen, heads * (n + 3), dim, dtype=dtype).view(heads, n + 3, dim)[:, :n]  # capacity slack unread
    got = launch_group_scores(q, keys.transpose(1, 2), None)
    want = torch.einsum("hgd,hnd->hgn", q.double(), keys.double()).float()
    abs_sum = torch.einsum("hgd,hnd->hgn", q.abs().double(), keys.abs().double()).float()
    return [("", _ratio(got, want, _sum_bound(dim, abs_sum)))]


CHECKS = {
    "topk_attention": check_topk,
    "ragged_decode": check_ragged,
    "page_minmax": check_page_minmax,
    "page_scores": check_page_scores,
    "reduced_scores": check_reduced_scores,
    "exact_logits": check_exact_logits,
}


def summary() -> bool:
    table: dict[tuple[str, str], list[Result]] = defaultdict(list)
    for r in RESULTS:
        table[(r.kernel, r.dtype)].append(r)
    print(f"\n{'kernel':<16} {'dtype':<6} {'cases':>5} {'pass':>5} {'fail':>5} {'worst err/tol':>14} {'max|err|':>10}")
    for (kernel, dtype), rows in table.items():
        fails = sum(not r.ok for r in rows)
        worst = max(r.worst for r in rows)
        max_abs = max(r.max_abs for r in rows)
        print(f"{kernel:<16} {dtype:<6} {len(rows):>5} {len(rows) - fails:>5} {fails:>5} {worst:>14.3f} "
              f"{max_abs:>10.2e}  {'PASS' if not fails else 'FAIL'}")
    failed = [r for r in RESULTS if not r.ok]
    print(f"\n{len(RESULTS) - len(failed)} passed, {len(failed)} failed")
    for r in failed:
        print(f"FAILED {r.kernel} {r.dtype} {r.case}: {r.note}")
    return not failed


def main() -> int:
    global DEVICE
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="fp16,bf16,fp32", help="comma-separated: fp16, bf16, fp32")
    parser.add_argument("--kernels", default=",".join(CHECKS), help=f"comma-separated: {', '.join(CHECKS)}")
    parser.add_argument("--quick", action="store_true", help="a few shapes per kernel")
    parser.add_argument("--tiny", action="store_true",
                        help="a few small cases per kernel, one head dim and group (the CPU smoke test's grid)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: the same checks in Triton's interpreter (TRITON_INTERPRET=1), to test this script")
    args = parser.parse_args()
    interpret = os.environ.get("TRITON_INTERPRET", "0").strip().lower() not in ("", "0", "false", "off", "no")
    if args.device == "cpu":
        if not interpret:
            print("gpu_check_kernels: --device cpu needs TRITON_INTERPRET=1", file=sys.stderr)
            return 2
    elif not torch.cuda.is_available():
        print("gpu_check_kernels: no CUDA device; the compiled Triton kernels are checked on a GPU only")
        return 0
    elif interpret:  # triton reads it once, at import: the kernels would run in the interpreter
        print("gpu_check_kernels: TRITON_INTERPRET is set; unset it to check the compiled kernels", file=sys.stderr)
        return 2
    DEVICE = args.device
    grid = "tiny" if args.tiny else "quick" if args.quick else "full"
    import triton

    torch.backends.cuda.matmul.allow_tf32 = False  # the references' fp32 GEMMs in full fp32
    torch.backends.cudnn.allow_tf32 = False
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU (Triton interpreter)"
    print(f"{name}  torch {torch.__version__}  triton {triton.__version__}  CUDA {torch.version.cuda}", flush=True)
    start = time.perf_counter()
    for kernel in args.kernels.split(","):
        for dtype in args.dtypes.split(","):
            CHECKS[kernel](DTYPES[dtype], grid)
    ok = summary()
    print(f"{time.perf_counter() - start:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
