"""Per-token decode time of each method against the memory-bandwidth floor of the bytes it reads, on the
engine's own decode path.

    python scripts/bench_decode_latency.py                          # embedded SmolLM2, 8K context, t = 256
    python scripts/bench_decode_latency.py --dtype float32
    python scripts/bench_decode_latency.py --length 4096 --budget 128 --methods full,rocketkv,quest
    python scripts/bench_decode_latency.py --compile                # also the compiled step (engine.compile)

One dense prefill of a synthetic prompt is shared by every method (the sweep's snapshot path: selection
methods keep it whole, RocketKV's stage 1 evicts from it), then each method decodes `--steps` greedy tokens
after `--warmup` untimed ones through `Session.step`, exactly as an accuracy run does (top-k recall, a
fidelity metric, is off here so that it does not inflate the timings), in `--rounds` rounds that interleave
the methods, so that a slow spell of a shared machine does not land on one method alone. Reported: median and p90 ms per token
and the median's ratio to `full`, the K/V bytes each method holds and the token-equivalents it reads per KV
group and step by its own cost model (its traffic: the budget axis the methods are compared on).

The floor. A decode step reads every weight it multiplies (the layers and the output head, as the roofline's
`phase_costs` counts them; of the input embedding table it reads one row) and the K/V and auxiliary elements
the method's cost model counts. The run measures two read rates on this machine before the methods, and prints
each method's floor and its ratio at both:

- `stream`: the best of several passes of `torch.sum` over a buffer far larger than the caches: the rate
  at which this machine's memory can be read at all (a STREAM-style bound);
- `gemv`: the model's own weight products run back to back on one token: the rate at which PyTorch's
  matrix-vector kernels stream these weights (oneDNN in bfloat16, MKL in float32), the most any decode step
  built on them can reach.

ratio = ms/token / floor. The gemv rate is measured again right before each method's round, and the gemv
ratio is the median of the rounds' ratios (the printed gemv floor is ms/token over it). The gap between the
two floors is the BLAS's, not the harness's; what remains above the gemv floor is per-step work: attention,
selection, and the model's per-operator overhead in eager mode.

The last two columns split that (CPU): `eager` is the median step of `kvbench.bench.eager_floor.eager_step`, the
model's own modules written out by hand over a static cache of as many rows as the method reads per KV group
and step (the same K/V bytes: its cost model's rows, and for a method that scores every key to choose,
Exact-TopK, whose cost model counts only what it attends, also those keys, half a K/V row each), with the same
decode attention and nothing else, timed in every round right after the method; `vs eager` is the median over
the rounds of the method's ms/token over that round's eager step (this VM's speed drifts by tens of percent
within minutes: a reference timed once, at another moment, moved the ratio more than the methods did): what the
harness and the method's own work (selection, eviction, accounting) add to the cheapest eager step that reads
the same bytes.

`--compile`: every method also decodes through the compiled step on the static layout (`engine.compile=true`,
`kvbench.engine.compiled`), from the same prefill, interleaved with its eager run; each gets its own row
(`path`), and the compiled row's `vs path` is its speed-up over the method's eager row. Compiling happens in
the first warm-up step and is not timed (`compile` prints its seconds).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

from kvbench.bench.eager_floor import time_eager_steps
from kvbench.bench.timing import gemv_bandwidth, scored_keys, stream_bandwidth, time_decode
from kvbench.engine.compiled import decoder_for
from kvbench.engine.config import EngineConfig
from kvbench.engine.sample import _prefill_segment, sample_generator
from kvbench.engine.snapshots import PrefillSnapshots
from kvbench.methods import build_method
from kvbench.models import load_model
from kvbench.profiling.roofline import phase_costs

CONF = Path(__file__).resolve().parents[1] / "kvbench" / "conf" / "model"
DEFAULT_METHODS = "full,exact_topk,quest,sparq,hsa,rocketkv,snapkv,streamingllm"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2_135m", help="a kvbench/conf/model name")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto", help="auto, bfloat16 or float32")
    parser.add_argument("--length", type=int, default=8192 - 160, help="prompt tokens")
    parser.add_argument("--budget", type=int, default=256, help="tokens per KV group (per step, for selection)")
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps per method")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3, help="rounds over the methods (medians over all of them)")
    parser.add_argument("--methods", default=DEFAULT_METHODS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile", action="store_true", help="also the compiled decode step (engine.compile)")
    args = parser.parse_args(argv)

    cfg = OmegaConf.load(CONF / f"{args.model}.yaml")
    cfg.device, cfg.dtype = args.device, args.dtype
    lm = load_model(cfg)
    new_tokens = args.rounds * (args.warmup + args.steps) + 1
    if args.length + new_tokens > lm.max_positions:
        sys.exit(f"--length {args.length} + {new_tokens} decoded tokens exceed {lm.name}'s {lm.max_positions} positions")
    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(100, lm.model.config.vocab_size - 100, (args.length,), generator=gen).tolist()
    config = lm.model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    engine = EngineConfig(reuse_prefill=True, snapshot_cache_mb=1 << 16)
    shared = PrefillSnapshots(engine.snapshot_cache_mb)  # one dense prefill for every method
    dtype_bytes = torch.finfo(lm.dtype).bits // 8
    weights = phase_costs(config, args.length, 0.0, dtype_bytes)["decode_bytes_per_step"]  # every weight once
    stream, gemv = (stream_bandwidth(lm.dtype), gemv_bandwidth(lm.model)) if lm.device.type == "cpu" else (None, None)
    print(f"{lm.name} on {lm.device} ({torch.get_num_threads()} threads), {lm.dtype}, {args.length} prompt tokens, "
          f"budget t = {args.budget}, {args.rounds} rounds of {args.steps} timed steps after {args.warmup} warm-up")
    if stream is not None:
        print(f"read rates: stream {stream / 1e9:.1f} GB/s, gemv {gemv / 1e9:.1f} GB/s; weights read per step "
              f"{weights / 1e6:.0f} MB (floor {1e3 * weights / stream:.1f} ms stream, {1e3 * weights / gemv:.1f} ms gemv)")
    print(f"{'method':<14} {'path':<8} {'ms/token':>9} {'p90':>7} {'vs full':>8} {'vs path':>8} {'KV MiB':>8} "
          f"{'read tok/group/step':>20} {'KV MB/step':>11} {'floor stream':>13} {'ratio':>6} {'floor gemv':>11} "
          f"{'ratio':>6} {'eager':>8} {'vs eager':>8}")
    paths = ("eager", "compiled") if args.compile else ("eager",)
    runs = {}
    for name in args.methods.split(","):
        for path in paths:
            method = build_method(name)
            plan = method.plan(args.budget, sequence_length=args.length + new_tokens, new_tokens=new_tokens,
                               head_dim=head_dim)
            start = time.perf_counter()
            session, logits, *_ = _prefill_segment(lm, method, plan, ids, engine, shared, sample_generator(args.seed, "bench"))
            if path == "compiled":
                session.decoder = decoder_for(lm)
                session.begin_decode(new_tokens)  # one static layout for every round
            runs[name, path] = {"session": session, "logits": logits, "prefill_s": time.perf_counter() - start,
                                "times": [], "ratios": [], "eager": []}
    for _ in range(args.rounds):  # rounds interleave the methods, each timed right after its own gemv rate
        for (name, _), run in runs.items():  # each method's eager run before its compiled one
            rate = gemv_bandwidth(lm.model) if stream is not None else None
            times, run["logits"] = time_decode(lm, run["session"], run["logits"], args.warmup, args.steps)
            run["times"] += times
            run["ratios"].append((statistics.median(times), rate))
            if stream is not None:  # the eager step over the rows it read so far, timed right after it
                eager_session = runs[name, "eager"]["session"]  # a compiled run counts on the device until its end
                stats = eager_session.cache.stats
                rows = round(stats.read_token_equivalents / stats.layer_steps + scored_keys(eager_session))
                run["eager"].append(statistics.median(time_eager_steps(lm, rows, args.steps)[0]))
    baseline, eager_rows = {}, {}
    for (name, path), run in runs.items():
        median, p90 = statistics.median(run["times"]), float(np.percentile(run["times"], 90))
        baseline.setdefault(path, median)
        eager_rows.setdefault(name, median)
        session = run["session"]
        session.end_decode()
        if session.decode_path == "eager" and path == "compiled":
            print(f"{name:<14} {path:<8} ran eagerly: {session.decode_path_reason}")
            continue
        stats = session.cache.stats
        read = stats.read_token_equivalents / stats.layer_steps if stats.layer_steps else float("nan")
        steps = stats.layer_steps / len(session.cache.layers)
        kv_read = stats.read_elements / steps * dtype_bytes if steps else float("nan")
        floors = ""
        if stream is not None:
            floor_stream = 1e3 * (weights + kv_read) / stream
            gemv_ratio = statistics.median(ms * rate / (1e3 * (weights + kv_read)) for ms, rate in run["ratios"])
            eager = statistics.median(run["eager"])
            vs_eager = statistics.median(ms / ms_eager for (ms, _), ms_eager in zip(run["ratios"], run["eager"]))
            floors = (f"{kv_read / 1e6:11.1f} {floor_stream:10.1f} ms {median / floor_stream:6.2f} "
                      f"{median / gemv_ratio:8.1f} ms {gemv_ratio:6.2f} {eager:5.1f} ms {vs_eager:8.2f}")
        compile_note = f", compile {session.compile_s:.0f} s" if session.compiles else ""
        print(f"{name:<14} {path:<8} {median:9.1f} {p90:7.1f} {median / baseline[path]:8.2f} "
              f"{eager_rows[name] / median:8.2f} {session.cache.kv_bytes() / 2**20:8.1f} {read:20.0f} {floors}   "
              f"(prefill {run['prefill_s']:.1f} s{', shared' if run['prefill_s'] < 1 else ''}{compile_note})")


if __name__ == "__main__":
    main()
