"""Per-token decode time of the plain transformers model (SDPA, DynamicCache), no kvbench in the loop.

    python scripts/gpu_decode_floor.py --lengths 16384,32768    # Llama-3.1-8B shapes, random fp16 weights

The same random Llama-3.1-8B-shaped model as docs/gpu/README.md's profile (tiny_llama's byte vocabulary),
built on the GPU with transformers' own SDPA attention: a dense prefill of L random tokens, then `--steps`
greedy steps after `--warmup` untimed ones, each forward timed alone (synchronised), as the engine times its
decode steps. Prints the median and p90 ms per token and the weights-only floor (weight bytes / the copy
bandwidth measured by `kvbench.profiling.roofline`), to tell the model's GPU cost from the harness's per-step work.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import torch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="16384,32768")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--steps", type=int, default=45)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_decode_floor: no CUDA device; nothing to do")
        return 0
    from transformers import AutoModelForCausalLM, LlamaConfig

    from kvbench.models import cache_kwargs
    from kvbench.profiling.roofline import measure_peaks

    config = LlamaConfig(vocab_size=260, hidden_size=4096, intermediate_size=14336, num_hidden_layers=args.layers,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         max_position_embeddings=131072, rope_theta=500000.0)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float16, attn_implementation="sdpa").eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    gbps = measure_peaks(torch.device("cuda"))["bandwidth_gbps"]
    print(f"{torch.cuda.get_device_name()}: {weight_bytes / 2**30:.2f} GiB of fp16 weights, copy bandwidth "
          f"{gbps:.0f} GB/s: weights-only floor {weight_bytes / gbps / 1e6:.2f} ms/token")
    for length in map(int, args.lengths.split(",")):
        ids = torch.randint(4, 260, (1, length), device="cuda")
        with torch.inference_mode():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
            torch.cuda.synchronize()
            prefill = time.perf_counter() - t0
            cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            times = []
            for step in range(args.warmup + args.steps):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                out = model(input_ids=token, **cache_kwargs(model, cache), use_cache=True)
                torch.cuda.synchronize()
                times.append(1e3 * (time.perf_counter() - t0))
                token = out.logits[:, -1].argmax(-1, keepdim=True)
        timed = times[args.warmup:]
        print(f"L={length}: prefill {prefill:.3f} s, decode median {statistics.median(timed):.2f} ms/token, "
              f"p90 {np.percentile(timed, 90):.2f} ms (over {len(timed)} steps), peak "
              f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB", flush=True)
        del out, cache
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return 0


if __name__ == "__main__":
    sys.exit(main())
