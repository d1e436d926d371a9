"""Peak memory of block-wise KeyDiff vs a dense prefill of the same prompt, measured, on the engine's own path.

    python scripts/bench_blockwise_memory.py                      # embedded SmolLM2, 8K tokens, budget 512
    python scripts/bench_blockwise_memory.py --length 4096 --budget 256 --block 64 --model tiny_llama

For each configuration the prompt is prefilled (and a few tokens decoded) through `kvbench.engine.Session`,
exactly as an accuracy run does. Peak memory is measured, not computed: on CUDA the allocator's peak
(`torch.cuda.max_memory_allocated`, reset before each run); on CPU the process's resident-set high-water
mark (VmHWM, reset through /proc/self/clear_refs before each run) minus the resident set before the run.
The cache's own accounting (the most K/V bytes it held at any moment) is printed next to it. Ratios are
relative to the dense prefill.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from kvbench.engine.session import Session
from kvbench.methods import build_method
from kvbench.models import load_model
from kvbench.run.caches import release_host_memory

CONF = Path(__file__).resolve().parents[1] / "kvbench" / "conf" / "model"


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def measure(lm, method_name: str, params: dict, budget: int | None, ids: list[int], decode: int) -> dict:
    """One prefill (+ `decode` steps) on a fresh cache; peak memory above the state before it."""
    gc.collect()
    release_host_memory()
    cuda = lm.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        Path("/proc/self/clear_refs").write_text("5")  # reset the RSS high-water mark (Linux >= 4.0)
        base = _status_kib("VmRSS") * 1024
    start = time.perf_counter()
    session = Session(lm, build_method(method_name, **params), budget)
    logits, _ = session.prefill(ids, compress=True)
    for _ in range(decode):
        logits = session.step(int(logits.argmax()))
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = _status_kib("VmHWM") * 1024 - base
    seconds = time.perf_counter() - start
    result = {"peak": peak, "kv_peak": session.cache.kv_peak_bytes, "entries": session.cache.peak_entries_per_head(),
              "seconds": seconds}
    del session, logits
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2_135m", help="a kvbench/conf/model name")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--length", type=int, default=8192 - 64, help="prompt tokens")
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--decode", type=int, default=8, help="tokens decoded after the prefill")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    cfg = OmegaConf.load(CONF / f"{args.model}.yaml")
    cfg.device = args.device
    lm = load_model(cfg)
    if args.length + args.decode > lm.max_positions:
        sys.exit(f"--length {args.length} + --decode {args.decode} exceeds {lm.name}'s {lm.max_positions} positions")
    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(100, lm.model.config.vocab_size - 100, (args.length,), generator=gen).tolist()
    runs = [
        ("dense prefill (full)", "full", {}, None),
        (f"one-shot KeyDiff (dense pass, then evict to {args.budget})", "keydiff", {"block_size": None}, args.budget),
        (f"block-wise KeyDiff (block {args.block}, budget {args.budget})", "keydiff", {"block_size": args.block},
         args.budget),
    ]
    measure(lm, "full", {}, None, ids[:256], 1)  # warm-up: allocator pools, lazy initialisation
    print(f"{lm.name} on {lm.device}, {lm.dtype}, {args.length} prompt tokens + {args.decode} decoded; "
          f"peak = {'CUDA allocator peak' if lm.device.type == 'cuda' else 'RSS high-water mark'} above the "
          "state before the run")
    print(f"{'configuration':<52} {'peak MiB':>9} {'ratio':>6} {'KV peak MiB':>11} {'ratio':>6} "
          f"{'max entries/head':>16} {'seconds':>8}")
    dense = None
    for label, name, params, budget in runs:
        r = measure(lm, name, params, budget, ids, args.decode)
        dense = dense or r
        print(f"{label:<52} {r['peak'] / 2**20:9.1f} {r['peak'] / dense['peak']:6.3f} {r['kv_peak'] / 2**20:11.1f} "
              f"{r['kv_peak'] / dense['kv_peak']:6.3f} {r['entries']:16d} {r['seconds']:8.1f}")


if __name__ == "__main__":
    main()
