"""Triton's CUDA compiler, on the CPU, over every kernel a GPU run compiles: what it would refuse on an H100.

    python scripts/check_cuda_codegen.py                         # both parts, sm_90 (H100)
    python scripts/check_cuda_codegen.py --archs h100,a100 --part kernels
    python scripts/check_cuda_codegen.py --part steps --models tiny_llama --methods quest,rocketkv
    python scripts/check_cuda_codegen.py --part steps --model-dtype bfloat16      # a GPU run's dtype
    python scripts/check_cuda_codegen.py --part steps --models llama3.1_8b_layer  # and its widths

Runs without `TRITON_INTERPRET` (the interpreter compiles nothing). No GPU is needed: Triton compiles for a target
it is given, down to a cubin by its own ptxas (`kvbench.devtools.cuda_target`). Two parts:

- `kernels`: each Triton kernel of `kvbench.kernels`, launched by its own launcher at the shapes a GPU run gives
  it (each configured model's attention, `SHAPES`: Llama-3.1-8B's 8 KV heads of 4 query heads and head dim 128,
  no GQA, groups of 3, 7 and 8, SmolLM2's head dim 64; prompts of 32K and 128K, the static layout's capacity
  1.25 x the prompt, budget 1,024; bf16 and fp32), each launch compiled instead of run. The compiled step's two
  operators (`kvbench::flash_decode`, plain and over selected slots, and `kvbench::stable_topk` at each
  selection's shape) and the eager path's kernels. Printed: kernel, shared memory, registers and spilled bytes
  per thread (the cubin's, by Triton's cuobjdump), compile seconds, constexprs (every compile of the first
  model; of the others, only what they compile anew).
- `steps`: every static method's compiled decode step (`scripts/check_static_decode.py`'s table, two steps; the
  tiny models, or `--models llama3.1_8b_layer`: one layer of Llama-3.1-8B's widths in bf16) compiled by `kvbench.devtools.graph_lint.cuda_codegen_backend`: inductor's Triton code for the step,
  every kernel and configuration compiled for the target. A refused kernel makes the step fall back to eager,
  as it would on the GPU, and the method's line names what Triton refused.

The exit status is 1 when anything is refused. A GPU machine still has to say what only it can (speed, and the
launch heuristics its properties give inductor): `scripts/gpu_session.sh`.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable

import torch

from kvbench.bench.shapes import LAYER_MODEL, model_config, topk_cases
from kvbench.devtools import static_decode
from kvbench.devtools.cuda_target import ARCHS, TritonRefusal, compile_launches

BUDGET = 1024  # the papers' usual budget
LENGTHS = (32768, 131072)
CAPACITY_FACTOR = 1.25
# (KV heads, query heads per KV head, head dim) of the configured models' attention (their config.json files):
# Triton specializes a launch by its integer arguments (a group of 1, multiples of 16) and its block sizes (by
# the head dim), so each shape may compile other code
SHAPES = {
    "llama3.1_8b": (8, 4, 128),  # also Llama-3-8B's long-context variants, DeepSeek-R1-Distill-Llama-8B, Mistral-7B
    "llama3.1_70b": (8, 8, 128),
    "llama3.2_3b": (8, 3, 128),
    "qwen2.5_7b": (4, 7, 128),  # also DeepSeek-R1-Distill-Qwen-7B
    "qwen2.5_3b": (2, 8, 128),
    "yi_9b": (4, 8, 128),
    "longchat_7b": (32, 1, 128),  # Llama-2: no GQA
    "smollm2_135m": (3, 3, 64),
}


def kernel_launches(length: int, dtype: torch.dtype, shape: tuple[int, int, int] = SHAPES["llama3.1_8b"],
                    ) -> list[tuple[str, Callable[[], object]]]:
    """(label, launch) of every kernel at a prompt of `length` tokens and an attention `shape` (KV heads, group,
    head dim): each launch calls the launcher a GPU run calls, with tensors of the run's shapes (never filled:
    only shapes, dtypes and strides reach the compiler)."""
    from kvbench.kernels import page_summary, ragged_attention, reduced_scores, sparse_attention
    from kvbench.kernels._distinct_rows_kernels import launch_distinct_rows
    from kvbench.kernels._group_scores_kernels import launch_group_scores
    from kvbench.kernels._stable_topk_kernels import launch_stable_topk
    from kvbench.kernels.flash_decode import flash_decode, flash_decode_selected

    kv_heads, group, dim = shape
    rows = math.ceil(length * CAPACITY_FACTOR)
    q = torch.empty(kv_heads, group, dim, dtype=dtype)
    keys = torch.empty(kv_heads * rows, dim, dtype=dtype)  # the static layout's flat rows (pages never touched)
    by_head = keys.view(kv_heads, rows, dim)
    starts = torch.arange(kv_heads) * rows
    fill = torch.full((kv_heads,), length)
    scale = dim ** -0.5
    shared = torch.zeros(kv_heads, 1, BUDGET, dtype=torch.int64).expand(kv_heads, group, BUDGET)
    per_head = torch.zeros(kv_heads, group, BUDGET, dtype=torch.int64)
    page = 16
    kmin = torch.empty(kv_heads, rows // page, dim, dtype=dtype)
    dims = torch.zeros(kv_heads, dim // 4, dtype=torch.int64)  # chosen dimensions (HSA, RocketKV: a quarter)
    keys_t = torch.empty(kv_heads, dim, rows, dtype=dtype)  # SparQ's second, transposed copy of the keys
    launches = [
        ("flash_decode (full)", lambda: flash_decode(q, keys, keys, starts, fill, scale)),
        ("flash_decode_selected (shared by the group)",
         lambda: flash_decode_selected(q, keys, keys, starts, fill, shared, scale)),
        ("flash_decode_selected (per query head)",
         lambda: flash_decode_selected(q, keys, keys, starts, fill, per_head, scale)),
        ("ragged_decode_attention", lambda: ragged_attention.ragged_decode_attention_triton(
            q, keys, keys, starts, [length] * kv_heads, scale)),
        ("topk_attention", lambda: sparse_attention.topk_attention_triton(q, by_head, by_head, per_head, scale)),
        ("page_minmax", lambda: page_summary.page_minmax_triton(by_head, page)),
        ("page_scores (Quest's, every dimension)", lambda: launch_group_scores(q, kmin.transpose(1, 2), None)),
        ("page_scores (HSA's chosen dimensions)", lambda: launch_group_scores(q, kmin.transpose(1, 2), dims)),
        ("reduced_scores", lambda: reduced_scores.reduced_scores_triton(q, keys_t, dims)),
        ("exact logits", lambda: launch_group_scores(q, by_head.transpose(1, 2), None)),
        ("distinct_rows (per query head)", lambda: launch_distinct_rows(per_head.view(kv_heads, -1), rows)),
    ]
    for case, n_rows, row_length, k in topk_cases(length, rows, BUDGET, kv_heads, group):
        scores = torch.empty(n_rows, row_length, dtype=dtype)
        launches.append((f"stable_topk ({case}, k {k})", lambda s=scores, k=k: launch_stable_topk(s, k)))
    return launches


def check_kernels(arch: int, dtypes: list[torch.dtype], shapes: list[str]) -> list[str]:
    """Compile every launch of `kernel_launches` for sm_`arch` at each model's shape; print a line per compiled
    kernel (the first model's in full, then only what the others compiled anew); the refusals."""
    refused = []
    print(f"\nkvbench.kernels for sm_{arch}")
    print(f"{'launch':64} {'kernel':27} {'shared KB':>9} {'regs':>4} {'spill B':>7} {'s':>4}  constexprs")
    seen: set[tuple[str, str, int]] = set()
    for model in shapes:
        count, new = 0, 0
        for length in LENGTHS:
            for dtype in dtypes:
                for label, launch in kernel_launches(length, dtype, SHAPES[model]):
                    label = f"{label}, {model} {length // 1024}K {str(dtype).removeprefix('torch.')}"
                    with compile_launches(arch) as compiled:
                        try:
                            launch()
                        except TritonRefusal as exc:
                            refused.append(f"{label}: {exc}")
                            print(f"{label:64} REFUSED {exc}")
                            continue
                    for item in compiled:
                        key = (item.kernel, item.constants, item.registers)
                        count += 1
                        if model != shapes[0] and key in seen:
                            continue
                        new += key not in seen
                        seen.add(key)
                        print(f"{label:64} {item.kernel:27} {item.shared_bytes / 1024:9.1f} {item.registers!s:>4} "
                              f"{item.local_bytes!s:>7} {item.seconds:4.1f}  {item.constants}")
                        label = ""
        kv_heads, group, dim = SHAPES[model]
        print(f"== {model} ({kv_heads} KV heads x {group}, head dim {dim}): {count} kernels compiled, {new} new")
    return refused


def check_steps(arch: int, models: list[str], methods: set[str] | None, dtype: str | None = None) -> list[str]:
    """Every static method's decode step (the model in `dtype`, default its config's), its inductor code compiled
    for sm_`arch`; the refusals."""
    from kvbench.devtools import graph_lint
    from kvbench.engine.compiled import CompiledDecoder
    from kvbench.models import load_model

    kernels: list[int] = []  # per graph compiled, for the method at hand
    refused = []
    for model in models:
        lm = load_model(model_config(model, dtype))
        decoder = CompiledDecoder(lm, graph_lint.cuda_codegen_backend(arch, kernels))
        print(f"\n{model} ({lm.dtype}): each static method's decode step, inductor's Triton code for sm_{arch}")
        print(f"{'method':22} {'path':9} {'graphs':>6} {'kernels':>7} {'s':>5}")
        for label, name, settings, budget in static_decode.STATIC:
            if methods is not None and label not in methods:
                continue
            if model == LAYER_MODEL and "pattern" in settings:
                print(f"{label:22} skipped: no DuoAttention pattern is calibrated for a random model")
                continue
            kernels.clear()
            start = time.perf_counter()
            ids = static_decode.prompt(budget + 10 if budget > 640 else 200, seed=1)
            method = static_decode.method_for(lm, name, settings)
            session, _, _ = static_decode.decode(lm, method, budget, ids, 2, decoder)
            line = (f"{label:22} {session.decode_path:9} {len(kernels):6d} {sum(kernels):7d} "
                    f"{time.perf_counter() - start:5.1f}")
            if session.decode_path != "compiled":
                refused.append(f"{model} {label}: {session.decode_path_reason}")
                line += f"  REFUSED {session.decode_path_reason}"
            print(line, flush=True)
    return refused


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--archs", default="h100", help=f"targets: {', '.join(ARCHS)}")
    parser.add_argument("--part", default="all", choices=["all", "kernels", "steps"])
    parser.add_argument("--dtypes", default="bfloat16,float32", help="the kernels' input dtypes")
    parser.add_argument("--shapes", default="all", help=f"the attention shapes of: {', '.join(SHAPES)} (all: each)")
    parser.add_argument("--models", default="tiny_llama,tiny_qwen3",
                        help=f"the steps' models: configs of kvbench/conf/model, or {LAYER_MODEL}")
    parser.add_argument("--model-dtype", default=None,
                        help="the steps' model dtype (default: its config's, float32 for the tiny ones; a GPU run's is bfloat16)")
    parser.add_argument("--methods", default="all", help="labels of check_static_decode's table (all: every one)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        parser.error("needs TRITON_INTERPRET unset or 0: Triton's interpreter compiles nothing")
    refused: list[str] = []
    for arch in (ARCHS[name] for name in args.archs.split(",")):
        if args.part in ("all", "kernels"):
            refused += check_kernels(arch, [getattr(torch, d) for d in args.dtypes.split(",")],
                                     list(SHAPES) if args.shapes == "all" else args.shapes.split(","))
        if args.part in ("all", "steps"):
            refused += check_steps(arch, args.models.split(","),
                                   None if args.methods == "all" else set(args.methods.split(",")), args.model_dtype)
    print("\nnothing refused" if not refused else f"\nREFUSED ({len(refused)}):\n  " + "\n  ".join(refused))
    return refused


if __name__ == "__main__":
    sys.exit(1 if main() else 0)
