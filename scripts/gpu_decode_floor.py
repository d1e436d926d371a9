"""Per-token decode time of the plain transformers model (SDPA, DynamicCache), no kvbench in the loop.

    python scripts/gpu_decode_floor.py --lengths 16384,32768    # Llama-3.1-8B shapes, random fp16 weights
    python scripts/gpu_decode_floor.py --device cpu --layers 1 --hidden 64 --intermediate 128 --heads 4 \
        --kv-heads 2 --head-dim 16 --dtype float32 --lengths 64 --steps 3 --warmup 1   # this script's CPU smoke test

The same random Llama-3.1-8B-shaped model as docs/gpu/README.md's profile (tiny_llama's byte vocabulary),
built on the GPU with transformers' own SDPA attention: a dense prefill of L random tokens, then `--steps`
greedy steps after `--warmup` untimed ones, each forward timed alone (synchronised), as the engine times its
decode steps. Prints the median and p90 ms per token and the weights-only floor (weight bytes / the copy
bandwidth: a large device-to-device copy, bytes read plus written, as `kvbench.profiling.roofline` measures it),
to tell the model's GPU cost from the harness's per-step work. `scripts/gpu_compiled_decode.py` builds its stock
model and measures its copy rate with this module's functions.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import numpy as np
import torch


def copy_gbps(device: torch.device) -> float:
    """GB/s of the fastest of five copies of a large buffer (256 MiB on a GPU, 64 MiB on a CPU; bytes read plus
    bytes written): `kvbench.profiling.roofline.measure_peaks`' copy without its matmuls."""
    from kvbench.profiling.roofline import best_seconds

    src = torch.ones((1 << 28 if device.type == "cuda" else 1 << 26) // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / best_seconds(lambda: dst.copy_(src), device) / 1e9


def add_shape_arguments(parser: argparse.ArgumentParser, layers: int) -> None:
    """The model-shape flags of the GPU scripts: Llama-3.1-8B's layer shapes by default, tiny ones to test."""
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--hidden", type=int, default=4096, help="hidden size (Llama-3.1-8B's by default)")
    parser.add_argument("--intermediate", type=int, default=14336, help="MLP size")
    parser.add_argument("--heads", type=int, default=32, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)


def random_model_cfg(args: argparse.Namespace, max_positions: int = 131072) -> Any:
    """kvbench's model config of the random model with `args`' shapes (`add_shape_arguments`, `--dtype`,
    `--device`): tiny_llama's source and byte vocabulary; load it under `torch.device(args.device)` so that the
    weights are initialised there (seconds on a GPU, minutes on the CPU for 8B shapes)."""
    from omegaconf import OmegaConf

    return OmegaConf.create({"name": "llama3.1_8b_shapes_random", "source": "tiny", "init_seed": 0,
                             "dtype": args.dtype, "device": args.device, "config": {
                                 "model_type": "llama", "hidden_size": args.hidden,
                                 "intermediate_size": args.intermediate, "num_hidden_layers": args.layers,
                                 "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads,
                                 "head_dim": args.head_dim, "max_position_embeddings": max_positions,
                                 "rope_theta": 500000.0}})


def stock_model(args: argparse.Namespace, device: torch.device, dtype: torch.dtype,
                max_positions: int = 131072) -> torch.nn.Module:
    """Stock transformers' Llama with `args`' shapes (layers, hidden, intermediate, heads, kv_heads, head_dim),
    tiny_llama's byte vocabulary, SDPA attention, random weights initialised on `device` (seed 0)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=260, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                         max_position_embeddings=max_positions, rope_theta=500000.0)
    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").eval()


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
