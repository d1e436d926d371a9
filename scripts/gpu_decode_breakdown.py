"""Wall time vs GPU kernel time of one decode step, per method, on the engine's decode path (CUDA).

    python scripts/gpu_decode_breakdown.py --length 16384 --budget 1024

The random Llama-3.1-8B-shaped model of docs/gpu/README.md (tiny_llama's source and byte vocabulary, fp16,
built directly on the GPU), one shared dense prefill of `--length` random tokens (the sweep's snapshot path,
as scripts/bench_decode_latency.py does), then per method: `--warmup` untimed greedy steps through
`Session.step`, `--steps` steps timed on the wall clock (synchronised, as the engine times them), and
`--profiled` more under torch.profiler, whose CUDA events give the GPU's own busy time per step (kernels
and copies, summed) and the number of them launched per step. Wall time well above GPU time means the step
is bound by the host (Python, launches, synchronisations), not by the GPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from omegaconf import OmegaConf

FIELDS = ("hidden_size=4096 intermediate_size=14336 num_hidden_layers={layers} num_attention_heads=32 "
          "num_key_value_heads=8 head_dim=128 max_position_embeddings=131072 rope_theta=500000.0")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=16384)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--methods", default="full,snapkv,adakv,quest,exact_topk,sparq,rocketkv")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--profiled", type=int, default=10)
    parser.add_argument("--device", default="cuda", help="cpu: only to test this script (no CUDA events)")
    parser.add_argument("--no-cudnn-sdpa", action="store_true",
                        help="torch.backends.cuda.enable_cudnn_sdp(False): SDPA picks another backend")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_decode_breakdown: no CUDA device; nothing to do")
        return 0
    if args.no_cudnn_sdpa:
        torch.backends.cuda.enable_cudnn_sdp(False)
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from kvbench.core.devices import sync
    from kvbench.engine.config import EngineConfig
    from kvbench.engine.sample import _prefill_segment, sample_generator
    from kvbench.engine.snapshots import PrefillSnapshots
    from kvbench.methods import build_method
    from kvbench.models import load_model

    cfg = OmegaConf.create({"name": "llama3.1_8b_shapes_random", "source": "tiny", "init_seed": 0,
                            "dtype": "float16", "device": args.device, "config": {"model_type": "llama"}})
    for item in FIELDS.format(layers=args.layers).split():
        key, value = item.split("=")
        cfg.config[key] = float(value) if "." in value else int(value)
    with torch.device(args.device):  # random init on the GPU: seconds (minutes on the CPU for 7B parameters)
        lm = load_model(cfg)
    gen = torch.Generator().manual_seed(0)
    new_tokens = args.warmup + args.steps + args.profiled + 1
    ids = torch.randint(4, lm.model.config.vocab_size, (args.length,), generator=gen).tolist()
    engine = EngineConfig(reuse_prefill=True, snapshot_cache_mb=1 << 16)
    shared = PrefillSnapshots(engine.snapshot_cache_mb)  # one dense prefill for every method
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"{name}: {args.layers} layers, {args.length} prompt tokens, budget {args.budget}, cuDNN SDPA "
          f"{'off' if args.no_cudnn_sdpa else 'allowed'}; "
          f"{args.steps} wall-timed and {args.profiled} profiled steps after {args.warmup} warm-up")
    print(f"{'method':<11} {'wall ms/step':>12} {'GPU busy ms/step':>17} {'GPU/wall':>9} {'GPU ops/step':>13}")
    for method_name in args.methods.split(","):
        method = build_method(method_name)
        plan = method.plan(args.budget, sequence_length=args.length + new_tokens, new_tokens=new_tokens,
                           head_dim=128)
        session, logits, *_ = _prefill_segment(lm, method, plan, ids, engine, shared, sample_generator(0, "bench"))
        token = int(logits.argmax())
        wall = []
        for step in range(args.warmup + args.steps):
            sync(lm.device)
            t0 = time.perf_counter()
            logits = session.step(token)
            sync(lm.device)
            if step >= args.warmup:
                wall.append(1e3 * (time.perf_counter() - t0))
            token = int(logits.argmax())
        with profile(activities=activities) as prof:
            for _ in range(args.profiled):
                logits = session.step(token)
                token = int(logits.argmax())
            sync(lm.device)
        gpu = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
        busy_ms = sum(e.time_range.elapsed_us() for e in gpu) / 1e3 / args.profiled
        median = statistics.median(wall)
        print(f"{method_name:<11} {median:12.2f} {busy_ms:17.2f} {busy_ms / median:9.2f} "
              f"{len(gpu) / args.profiled:13.0f}", flush=True)
        del session, logits
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
