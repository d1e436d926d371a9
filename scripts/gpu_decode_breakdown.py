"""Wall time vs GPU kernel time of one decode step, per method, on the engine's decode path (CUDA).

    python scripts/gpu_decode_breakdown.py --length 16384 --budget 1024
    python scripts/gpu_decode_breakdown.py --device cpu --layers 1 --hidden 64 --intermediate 128 --heads 4 \
        --kv-heads 2 --head-dim 16 --length 64 --budget 16 --dtype float32   # this script's CPU smoke test

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

from kvbench.bench.shapes import add_shape_arguments, random_model_cfg


def top_kernels(events: list, steps: int, top: int) -> str:
    """The `top` kernels (and copies) of most GPU time per step, with launches per step: where a step's time goes."""
    by_name: dict[str, list[float]] = {}
    for e in events:
        by_name.setdefault(e.name, []).append(e.time_range.elapsed_us())
    total = sum(sum(v) for v in by_name.values()) or 1.0
    rows = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    lines = [f"    {'us/step':>9} {'share':>6} {'launches/step':>13}  kernel"]
    for name, times in rows:
        lines.append(f"    {sum(times) / steps:9.1f} {sum(times) / total:6.1%} {len(times) / steps:13.1f}  {name[:110]}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=16384)
    parser.add_argument("--budget", type=int, default=1024)
    add_shape_arguments(parser, layers=32)
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--methods", default="full,snapkv,adakv,quest,exact_topk,sparq,rocketkv")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--profiled", type=int, default=10)
    parser.add_argument("--device", default="cuda", help="cpu: only to test this script (no CUDA events)")
    parser.add_argument("--compile", action="store_true",
                        help="the compiled decode step (engine.compile=true: static layout, CUDA graphs) instead of eager")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend of --compile")
    parser.add_argument("--top", type=int, default=0,
                        help="also list each method's N kernels of most GPU time per step, with their launches per step")
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
    from kvbench.engine.compiled import decoder_for
    from kvbench.engine.config import EngineConfig
    from kvbench.engine.sample import _prefill_segment, sample_generator
    from kvbench.engine.snapshots import PrefillSnapshots
    from kvbench.methods import build_method
    from kvbench.models import load_model

    cfg = random_model_cfg(args)
    with torch.device(args.device):  # random init on the GPU: seconds (minutes on the CPU for 7B parameters)
        lm = load_model(cfg)
    gen = torch.Generator().manual_seed(0)
    new_tokens = args.warmup + args.steps + args.profiled + 1
    ids = torch.randint(4, lm.model.config.vocab_size, (args.length,), generator=gen).tolist()
    engine = EngineConfig(reuse_prefill=True, snapshot_cache_mb=1 << 16)
    shared = PrefillSnapshots(engine.snapshot_cache_mb)  # one dense prefill for every method
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"{name}: {'compiled' if args.compile else 'eager'} decode step, {args.layers} layers, {args.length} prompt "
          f"tokens, budget {args.budget}, cuDNN SDPA "
          f"{'off' if args.no_cudnn_sdpa else 'allowed'}; "
          f"{args.steps} wall-timed and {args.profiled} profiled steps after {args.warmup} warm-up")
    print(f"{'method':<11} {'wall ms/step':>12} {'GPU busy ms/step':>17} {'GPU/wall':>9} {'GPU ops/step':>13}")
    for method_name in args.methods.split(","):
        method = build_method(method_name)
        plan = method.plan(args.budget, sequence_length=args.length + new_tokens, new_tokens=new_tokens,
                           head_dim=args.head_dim)
        session, logits, *_ = _prefill_segment(lm, method, plan, ids, engine, shared, sample_generator(0, "bench"))
        token = int(logits.argmax())
        if args.compile:  # the first step compiles (outside the timed steps: warm-up)
            session.decoder = decoder_for(lm, args.backend)
            session.begin_decode(new_tokens)
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
              f"{len(gpu) / args.profiled:13.0f}"
              f"{f'  ({session.decode_path}: {session.decode_path_reason})' if session.decode_path_reason else ''}",
              flush=True)
        if args.top:
            print(top_kernels(gpu, args.profiled, args.top), flush=True)
        if args.compile:
            session.end_decode()
        del session, logits
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
