"""Ragged (Ada-KV) decode vs dense decode over the same number of tokens, and the cost of one append.

    python scripts/bench_ragged_decode.py                 # cache micro-benchmark + SmolLM2 at 4K, 75% kept
    python scripts/bench_ragged_decode.py --length 8032 --budget 2048 --steps 32

1. The cache alone (no model): one append per head into a layer of L tokens, uniform and ragged, for growing
   L. Appends write into reserved slack, so the time must not grow with L (it did, linearly, when every
   append copied the layer). Then one decode attention step over a ragged layer (one SDPA per KV head on its
   rows) vs dense SDPA over a uniform layer holding the same number of tokens.
2. The model: per-token decode time of Ada-KV (ragged) vs SnapKV (uniform) at the same budget, i.e. the same
   kept tokens per layer, through the engine's decode path (`Session.step`). Target: ratio <= 1.3.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from kvbench.bench.timing import time_decode
from kvbench.cache.kvcache import KVBenchCache
from kvbench.engine.config import EngineConfig
from kvbench.engine.sample import _prefill_segment, sample_generator
from kvbench.engine.snapshots import PrefillSnapshots
from kvbench.kernels.decode_attention import decode_attention
from kvbench.methods import build_method
from kvbench.models import load_model

CONF = Path(__file__).resolve().parents[1] / "kvbench" / "conf" / "model"


def _layer(lens: list[int], dim: int, slack: int):
    layer = KVBenchCache(1).layers[0]
    layer.head_dim, layer.seen = dim, max(lens)
    layer._install({"keys": torch.randn(sum(lens), dim), "values": torch.randn(sum(lens), dim),
                    "positions": torch.zeros(sum(lens), dtype=torch.int32)}, lens, slack=slack)
    return layer


def _median_us(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(1e6 * (time.perf_counter() - t0))
    return statistics.median(times)


def cache_micro(heads: int, group: int, dim: int, lengths: list[int]) -> None:
    print(f"cache alone: {heads} KV heads x {group} query heads each, head dim {dim}, fp32")
    print(f"{'tokens/head':>11} {'append us (uniform)':>20} {'append us (ragged)':>19} "
          f"{'dense attn us':>14} {'ragged attn us':>15} {'ragged/dense':>13}")
    gen = torch.Generator().manual_seed(0)
    for length in lengths:
        appends = 64
        lens = [int(length * f) for f in torch.linspace(0.5, 1.5, heads).tolist()]  # same total, ragged
        row = []
        for layout in ([length] * heads, lens):
            layer = _layer(layout, dim, slack=appends)
            k = torch.randn(1, heads, 1, dim, generator=gen)
            row.append(_median_us(lambda: layer.update(k, k), appends))
        q = torch.randn(heads, group, dim, generator=gen)
        dense = _layer([length] * heads, dim, slack=0)
        ragged = _layer(lens, dim, slack=0)
        dense_us = _median_us(lambda: F.scaled_dot_product_attention(
            q.view(1, heads * group, 1, dim), dense.keys, dense.values, scale=0.1, enable_gqa=True), 30)
        ragged_us = _median_us(lambda: decode_attention(
            q, ragged.keys, ragged.values, 0.1, ragged.starts, ragged.lens, ragged.caps), 30)
        print(f"{length:>11} {row[0]:>20.1f} {row[1]:>19.1f} {dense_us:>14.1f} {ragged_us:>15.1f} "
              f"{ragged_us / dense_us:>13.2f}")


def model_decode(args: argparse.Namespace) -> None:
    cfg = OmegaConf.load(CONF / f"{args.model}.yaml")
    cfg.device = args.device
    if args.dtype:
        cfg.dtype = args.dtype
    lm = load_model(cfg)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(100, lm.model.config.vocab_size - 100, (args.length,), generator=gen).tolist()
    engine = EngineConfig(reuse_prefill=True, snapshot_cache_mb=1 << 16)
    shared = PrefillSnapshots(engine.snapshot_cache_mb)  # one dense prefill for every method
    print(f"\n{lm.name} on {lm.device} ({torch.get_num_threads()} threads), {lm.dtype}, {args.length} prompt "
          f"tokens, budget {args.budget} per head, {args.steps} timed steps after {args.warmup} warm-up")
    results = {}
    for name in ("snapkv", "adakv"):
        method = build_method(name)
        plan = method.plan(args.budget, sequence_length=args.length + args.steps, new_tokens=args.steps, head_dim=64)
        session, logits, *_ = _prefill_segment(lm, method, plan, ids, engine, shared, sample_generator(0, "bench"))
        ragged = sum(layer.is_ragged for layer in session.cache.layers)
        kept = sum(sum(layer.lengths()) for layer in session.cache.layers)
        times, _ = time_decode(lm, session, logits, args.warmup, args.steps)
        results[name] = (statistics.median(times), float(np.percentile(times, 90)))
        print(f"{name:<8} {results[name][0]:7.1f} ms/token (p90 {results[name][1]:.1f}), {kept} tokens kept, "
              f"{ragged} of {len(session.cache.layers)} layers ragged")
    print(f"ragged / dense decode per token: {results['adakv'][0] / results['snapkv'][0]:.2f} (target <= 1.3)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2_135m")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default=None, help="override the model config's dtype")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--budget", type=int, default=3072)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--cache-lengths", default="1024,4096,16384", help="tokens per head of the cache alone")
    parser.add_argument("--skip-model", action="store_true")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    cache_micro(heads=8, group=4, dim=128, lengths=[int(n) for n in args.cache_lengths.split(",")])
    if not args.skip_model:
        model_decode(args)


if __name__ == "__main__":
    main()
