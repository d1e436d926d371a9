"""Per-token decode time of the plain transformers model (SDPA, DynamicCache), no kvbench in the loop.

    python scripts/gpu_decode_floor.py --lengths 16384,32768    # Llama-3.1-8B shapes, random fp16 weights
    python scripts/gpu_decode_floor.py --device cpu --layers 1 --hidden 64 --intermediate 128 --heads 4 \
        --kv-heads 2 --head-dim 16 --dtype float32 --lengths 64 --steps 3 --warmup 1   # this script's CPU smoke test

The same random Llama-3.1-8B-shaped model as docs/gpu/README.md's profile (tiny_llama's byte vocabulary),
built on the GPU with transformers' own SDPA attention: a dense prefill of L random tokens, then `--steps`
greedy steps after `--warmup` untimed ones, each forward timed alone (synchronised), as the engine times its
decode steps. Prints the median and p90 ms per token and the weights-only floor (weight bytes / the copy
bandwidth: a large device-to-device copy, bytes read plus written, as `kvbench.profiling.roofline` measures it),
to tell the model's GPU cost from the harness's per-step work. The stock model and the copy rate are
`kvbench.bench`'s (`shapes.stock_model`, `timing.copy_gbps`), which `scripts/gpu_compiled_decode.py` uses too.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import torch

from kvbench.bench.shapes import add_shape_arguments, stock_model
from kvbench.bench.timing import copy_gbps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="16384,32768")
    add_shape_arguments(parser, layers=32)
    parser.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"))
    parser.add_argument("--device", default="cuda", help="cpu: only to test this script")
    parser.add_argument("--steps", type=int, default=45)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_decode_floor: no CUDA device; nothing to do")
        return 0
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    from kvbench.core.devices import sync
    from kvbench.models import cache_kwargs

    model = stock_model(args, device, dtype)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    gbps = copy_gbps(device)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"{name}: {weight_bytes / 2**30:.2f} GiB of {args.dtype} weights, copy bandwidth "
          f"{gbps:.0f} GB/s: weights-only floor {weight_bytes / gbps / 1e6:.2f} ms/token")
    for length in map(int, args.lengths.split(",")):
        ids = torch.randint(4, 260, (1, length), device=device)
        with torch.inference_mode():
            sync(device)
            t0 = time.perf_counter()
            out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
            sync(device)
            prefill = time.perf_counter() - t0
            cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            times = []
            for step in range(args.warmup + args.steps):
                sync(device)
                t0 = time.perf_counter()
                out = model(input_ids=token, **cache_kwargs(model, cache), use_cache=True)
                sync(device)
                times.append(1e3 * (time.perf_counter() - t0))
                token = out.logits[:, -1].argmax(-1, keepdim=True)
        timed = times[args.warmup:]
        peak = f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if device.type == "cuda" else "- (CPU)"
        print(f"L={length}: prefill {prefill:.3f} s, decode median {statistics.median(timed):.2f} ms/token, "
              f"p90 {np.percentile(timed, 90):.2f} ms (over {len(timed)} steps), peak {peak}", flush=True)
        del out, cache
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    return 0


if __name__ == "__main__":
    sys.exit(main())
