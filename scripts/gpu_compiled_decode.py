"""The compiled decode step on one GPU: the static-decode check, then eager and compiled ms/token per method against
the bandwidth floor of the bytes each step reads and against stock transformers' compiled StaticCache step.

    python scripts/gpu_compiled_decode.py                      # 390 s on an H100 (docs/gpu/README.md, section 4)
    python scripts/gpu_compiled_decode.py --no-check --lengths 32768 --methods full,stock,snapkv,quest
    python scripts/gpu_compiled_decode.py --device cpu --dtype float32 --layers 1 --hidden 64 --intermediate 128 \\
        --heads 4 --kv-heads 2 --head-dim 16 --lengths 256 --budget 32 --backend eager   # CPU smoke test

(a) `scripts/check_static_decode.py --backend inductor` on the tiny models moved to `--device` (the script loads
them where their configs say, the CPU: each shard runs its `main` with `load_model` placing the model on the
device first), every static method, split over `--check-shards` processes that run side by side (each compiles
its own graphs; the GPU work is tiny); their rows are merged into one table per model. A method that should
compile and does not, recompiles or changes a token fails the check, and this script then exits 1.

(b) The random Llama-3.1-8B-shaped model of docs/gpu/README.md (hidden 4096, 32 query / 8 KV heads, head dim
128, MLP 14336, `--layers` 8, tiny_llama's byte vocabulary, `--dtype` bf16), built directly on the device. Per
prompt length, one dense prefill of random tokens shared by every method (scripts/bench_decode_latency.py's
snapshot path), then per method two sessions from it: one decodes eagerly, one through the compiled step
(`engine.compile`'s `CompiledDecoder`, CUDA graphs with inductor on CUDA), each `--warmup` untimed greedy steps
(the compiled one compiles in its first) and `--steps` timed ones (synchronised, median). `stock` is stock
transformers on the same shapes: `LlamaForCausalLM` with SDPA and a `StaticCache` of L + the decoded tokens,
one decode step wrapped in `torch.compile(mode="reduce-overhead", fullgraph=True, dynamic=False)` (its eager
row: the same step uncompiled); its cache holds random keys and values at positions 0..L-1 instead of a
prefill (its attention reads the whole `max_cache_len` every step whatever the rows hold).

The floor of a step is the bytes it must read divided by the copy rate measured in this process (a 256 MiB
device-to-device copy, bytes read plus written: `kvbench.bench.timing.copy_gbps`): every weight once
(`kvbench.profiling.roofline.phase_costs`), plus the K/V and auxiliary elements of the method's own traffic
accounting (`Method.step_traffic`, summed by the cache's `DecodeStats`: Quest's page summaries, SparQ's
reduced keys, Ada-KV's ragged rows, RocketKV's both stages), plus, for a method that scores every key to
choose (`scores_every_key`: Exact-TopK), those keys (`kvbench.bench.timing.scored_keys`). Stock
reads its whole static cache.

(c) The seconds each compiled run spent compiling (`Session.compile_s`; 0 when it replayed a graph compiled
for an earlier run of the same layout shape, e.g. SnapKV's budgeted cache at another prompt length).

Printed as one markdown table, with compiled/floor, compiled/stock (at the same length), the speedup over full
(full's compiled ms / the method's) next to full's bytes over the method's (what the bytes alone allow), their
quotient ("of bytes": issue 45 asks a selection method for 0.8), and compiled/snapkv: the step over SnapKV's at
the same length and budget, which reads about the bytes a selection method's budget allows and selects nothing
at decode, so what is left is what the selection itself costs. SnapKV's own "of bytes", printed under the table
for each length, is then about the most that a method reading its bytes reaches while the rest of the step
(weights, norms, the rotary embedding, the attention's launches) costs what it does. Written as CSV (`--csv`). Work runs in priority order, interleaving the lengths (each length's first method,
then each one's second, ...), and stops starting new work when the estimate of the next item would pass
`--deadline-s` (counted from the start, the check included): skipped items get a row saying so, and the table
is printed anyway (also on SIGTERM, e.g. from `timeout`).

`--rounds N` measures kvbench's items N times, interleaved (every item once, then again: a drift of the machine
falls on every method alike), stock once (it would compile its step again): the table's ms are the median of the
rounds' medians and the CSV holds the spread (max - min) / median beside them (`eager_spread`, `compiled_spread`),
also printed under the table. Every row names the attention its decode steps ran (`decode_attention`:
`kvbench.engine.record.dense_decode_attention`'s names, `stock_sdpa_static_cache` for stock) and the full row's
(`baseline_attention`), which its speedup divides by.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch

DEFAULT_METHODS = "full,stock,snapkv,quest,adakv,rocketkv,sparq,hsa,exact_topk,full_repeated_kv"
DEFAULT_METHODS_AT = ["131072=full,stock,snapkv,quest"]
# labels that are not a method's registered name: (method, settings)
LABELS = {"full_repeated_kv": ("full", {"repeat_kv": True})}
COLUMNS = ["length", "method", "status", "eager_ms", "compiled_ms", "compile_s", "compiles", "replayed", "path",
           "weights_mb", "kv_aux_mb", "bytes_mb", "floor_ms", "eager_over_floor", "compiled_over_floor",
           "compiled_over_stock", "speedup_vs_full", "speedup_vs_repeated_kv", "full_bytes_over_bytes", "of_bytes",
           "compiled_over_snapkv", "eager_p90_ms", "compiled_p90_ms", "rounds", "eager_spread", "compiled_spread", "decode_attention", "baseline_attention",
           "held_rows", "capacity_rows", "runtime_counts", "prefill_s", "seconds", "note"]


class Deadline(Exception):
    """SIGTERM (a `timeout` around this script): stop, print what was measured."""


@dataclass
class Row:
    length: int
    method: str
    status: str = "ok"
    values: dict[str, Any] = field(default_factory=dict)

    def get(self, key: str) -> Any:
        return self.values.get(key)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from kvbench.bench.shapes import add_shape_arguments

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda, or cpu (only to test this script, tiny shapes)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    add_shape_arguments(parser, layers=8)
    parser.add_argument("--lengths", default="32768,131072", help="prompt lengths, comma-separated")
    parser.add_argument("--methods", default=DEFAULT_METHODS,
                        help="labels run at every length not named by --methods-at, in priority order: a method's "
                             f"name, {', '.join(LABELS)}, or stock (stock transformers' compiled StaticCache step)")
    parser.add_argument("--methods-at", action="append", default=None, metavar="L=LIST",
                        help=f"the labels at prompt length L (repeatable; default {' '.join(DEFAULT_METHODS_AT)})")
    parser.add_argument("--budget", type=int, default=1024, help="tokens per KV group")
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps per run")
    parser.add_argument("--warmup", type=int, default=4, help="untimed steps before them (the compile, CUDA graphs)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="interleaved rounds over the work (kvbench's methods; stock once): ms are the median of "
                             "the rounds' medians, the spread (max - min) / median is written beside them")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend: inductor, or eager/aot_eager")
    parser.add_argument("--compile-threads", type=int, default=os.cpu_count() or 1,
                        help="torch._inductor.config.compile_threads (parallel Triton compiles)")
    parser.add_argument("--deadline-s", type=float, default=420.0,
                        help="start no item whose estimate would end past this many seconds after the start")
    parser.add_argument("--compile-estimate-s", type=float, default=None,
                        help="a compile's seconds before one was measured (default 40 on CUDA with inductor, else 5)")
    parser.add_argument("--csv", default="compiled_decode.csv", help="where to write the rows ('' for nowhere)")
    parser.add_argument("--seed", type=int, default=0)
    check = parser.add_argument_group("the static-decode check (scripts/check_static_decode.py)")
    check.add_argument("--no-check", dest="check", action="store_false")
    check.add_argument("--check-models", default="tiny_llama,tiny_qwen3")
    check.add_argument("--check-methods", default="all", help="labels of check_static_decode.py's STATIC list")
    check.add_argument("--check-backend", default=None, help="default: --backend")
    check.add_argument("--check-steps", type=int, default=32)
    check.add_argument("--check-length", type=int, default=700)
    check.add_argument("--check-shards", type=int, default=6, help="processes side by side")
    check.add_argument("--check-timeout-s", type=float, default=150.0)
    args = parser.parse_args(argv)
    args.lengths = [int(n) for n in args.lengths.split(",")]
    at = dict(item.split("=", 1) for item in (args.methods_at if args.methods_at is not None else DEFAULT_METHODS_AT))
    args.plan = {length: (at.get(str(length)) or args.methods).split(",") for length in args.lengths}
    if args.check_backend is None:
        args.check_backend = args.backend
    if args.compile_estimate_s is None:
        args.compile_estimate_s = 40.0 if args.device == "cuda" and args.backend == "inductor" else 5.0
    return args


# -- (a) the static-decode check, sharded -------------------------------------------------------------------


# one shard of the check: `kvbench.devtools.static_decode`'s main (scripts/check_static_decode.py's), its tiny models loaded on the device asked for
CHECK_SHARD = """
import sys

from kvbench.devtools import static_decode as check

load_model = check.load_model


def on_device(cfg):
    cfg.device = {device!r}
    return load_model(cfg)


check.load_model = on_device
sys.exit(1 if any(not outcome.ok for outcome in check.main(sys.argv[1:])) else 0)
"""
CHECK_HEADER = re.compile(r"^(\S+) \((.*), backend (.+), (\d+) steps\)$")


def static_check(args: argparse.Namespace, time_left: float) -> bool:
    """Run check_static_decode.py in `--check-shards` processes side by side and print their rows merged.
    True when every shard exited 0 (every method as expected)."""
    from kvbench.devtools.static_decode import HEADER, STATIC

    labels = [label for label, *_ in STATIC]
    if args.check_methods != "all":
        labels = [label for label in labels if label in set(args.check_methods.split(","))]
    shards = [labels[i::args.check_shards] for i in range(min(args.check_shards, len(labels)))]
    threads = max(1, (os.cpu_count() or 1) // max(1, len(shards)))
    env = dict(os.environ, PYTHONUNBUFFERED="1", TORCHINDUCTOR_COMPILE_THREADS=str(threads))
    limit = max(1.0, min(args.check_timeout_s, time_left))
    print(f"== (a) static-decode check on {args.device}: {len(labels)} methods x {args.check_models}, "
          f"backend {args.check_backend}, "
          f"{args.check_steps} steps, {len(shards)} processes side by side ({threads} compile threads each), "
          f"limit {limit:.0f} s", flush=True)
    start = time.perf_counter()
    code = CHECK_SHARD.format(device=args.device)
    procs = [subprocess.Popen([sys.executable, "-c", code, "--backend", args.check_backend,
                               "--models", args.check_models, "--methods", ",".join(shard), "--steps",
                               str(args.check_steps), "--length", str(args.check_length)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for shard in shards]
    outputs = []
    try:
        for proc in procs:
            try:
                out, err = proc.communicate(timeout=max(1.0, limit - (time.perf_counter() - start)))
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
                outputs.append((None, out, err))
                continue
            outputs.append((proc.returncode, out, err))
    finally:  # SIGTERM while waiting: no shard outlives this process
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    headers: dict[str, str] = {}
    rows: dict[str, dict[str, str]] = {}
    for _, out, _ in outputs:
        model = None
        for line in out.splitlines():
            match = CHECK_HEADER.match(line)
            if match:
                model = match.group(1)
                headers.setdefault(model, line)
            elif model is not None and line.split(" ", 1)[0] in labels:
                rows.setdefault(model, {})[line.split(" ", 1)[0]] = line
    for model in args.check_models.split(","):
        print(f"\n{headers.get(model, model + ' (no output)')}")
        print(HEADER)
        for label in labels:
            print(rows.get(model, {}).get(label, f"{label:22} NO RESULT (its process crashed or timed out)"))
    failed = []
    for shard, (rc, _, err) in zip(shards, outputs):
        if rc != 0:
            failed.append(shard)
            tail = "\n    ".join(err.strip().splitlines()[-8:])
            why = "timed out" if rc is None else f"exit {rc}"
            print(f"\nshard {','.join(shard)}: {why}" + (f"; stderr ends:\n    {tail}" if tail else ""))
    ok = not failed
    print(f"\nstatic-decode check: {'all methods as expected' if ok else 'FAILED'} "
          f"({time.perf_counter() - start:.0f} s)\n", flush=True)
    return ok


# -- (b) eager and compiled decode per method ---------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace):
        from kvbench.bench.shapes import random_model_cfg
        from kvbench.bench.timing import copy_gbps
        from kvbench.engine.config import EngineConfig
        from kvbench.engine.snapshots import PrefillSnapshots
        from kvbench.models import load_model
        from kvbench.profiling.roofline import phase_costs

        self.args = args
        self.device = torch.device(args.device)
        new = args.warmup + args.steps + 1
        self.new_tokens = new
        max_positions = max(131072, max(args.lengths) + 2 * new + 64)
        cfg = random_model_cfg(args, max_positions)
        start = time.perf_counter()
        with torch.device(self.device):  # random init on the GPU: seconds (minutes on the CPU for 8B shapes)
            self.lm = load_model(cfg)
        self.build_s = time.perf_counter() - start
        self.max_positions = max_positions
        self.dtype_bytes = torch.finfo(self.lm.dtype).bits // 8
        self.weights = phase_costs(self.lm.model.config, 0, 0.0, self.dtype_bytes)["decode_bytes_per_step"]
        self.gbps = copy_gbps(self.device)
        self.engine = EngineConfig(reuse_prefill=True, snapshot_cache_mb=1 << 17)
        self.shared = PrefillSnapshots(self.engine.snapshot_cache_mb)  # one dense prefill per length
        gen = torch.Generator().manual_seed(args.seed)
        vocab = self.lm.model.config.vocab_size
        self.ids = {n: torch.randint(4, vocab, (n,), generator=gen).tolist() for n in args.lengths}
        self.prefilled: set[int] = set()  # lengths with a dense prefill made
        self.decoder: Any = None
        self.decoder_error: str | None = None
        self.stock: Any = None
        self.compile_seen: list[float] = []

    def floor_ms(self, nbytes: float) -> float:
        return nbytes / (self.gbps * 1e9) * 1e3

    def kvbench_decoder(self) -> Any:
        from kvbench.engine.compiled import decoder_for

        if self.decoder is None and self.decoder_error is None:
            try:
                self.decoder = decoder_for(self.lm, self.args.backend)
            except Exception as exc:  # noqa: BLE001 - e.g. a torch.compile without an argument it passes
                self.decoder_error = f"no compiled decoder: {type(exc).__name__}: {exc}"
        return self.decoder

    def session(self, name: str, settings: dict, length: int):
        from kvbench.engine.sample import _prefill_segment, sample_generator
        from kvbench.methods import build_method

        method = build_method(name, **settings)
        plan = method.plan(self.args.budget, sequence_length=length + self.new_tokens, new_tokens=self.new_tokens,
                           head_dim=self.args.head_dim)
        session, logits, prefill_s, _, reused = _prefill_segment(self.lm, method, plan, self.ids[length], self.engine,
                                                                 self.shared, sample_generator(self.args.seed, "bench"))
        self.prefilled.add(length)
        return session, logits, prefill_s

    def run_method(self, length: int, label: str) -> Row:
        from kvbench.bench.timing import step_read_bytes, time_decode
        from kvbench.engine.record import dense_decode_attention

        args = self.args
        name, settings = LABELS.get(label, (label, {}))
        row = Row(length, label)
        session, logits, prefill_s = self.session(name, settings, length)
        eager, _ = time_decode(self.lm, session, logits, args.warmup, args.steps)
        kv_aux, eager_attention = step_read_bytes(session, self.dtype_bytes), dense_decode_attention(session, self.lm)
        del session, logits
        self.free()
        row.values.update(eager_ms=statistics.median(eager), eager_p90_ms=percentile(eager, 90), prefill_s=prefill_s,
                          kv_aux_mb=kv_aux / 1e6, weights_mb=self.weights / 1e6, bytes_mb=(self.weights + kv_aux) / 1e6,
                          decode_attention=eager_attention)
        decoder = self.kvbench_decoder()
        if decoder is None:
            row.values.update(path="eager", note=self.decoder_error)
            return row
        session, logits, _ = self.session(name, settings, length)
        session.decoder = decoder
        session.begin_decode(self.new_tokens)
        compiled, _ = time_decode(self.lm, session, logits, args.warmup, args.steps)
        row.values.update(static_rows(session))
        session.end_decode()
        row.values.update(path=session.decode_path, compile_s=session.compile_s, compiles=session.compiles,
                          replayed=session.replayed_steps, decode_attention=dense_decode_attention(session, self.lm))
        if session.decode_path == "compiled":
            row.values.update(compiled_ms=statistics.median(compiled), compiled_p90_ms=percentile(compiled, 90))
            if session.compiles:
                self.compile_seen.append(session.compile_s)
            notes = [f"{session.compiles} graphs compiled"] if session.compiles > 1 else []
            if session.replayed_steps == 0:  # kvbench.engine.replay: the steps went through dynamo's guards
                notes.append("not replayed")
            row.values["note"] = ", ".join(notes) or None
        else:
            row.values["note"] = session.decode_path_reason or "ran eagerly"
        del session, logits
        self.free()
        return row

    def run_stock(self, length: int) -> Row:
        """Stock transformers: LlamaForCausalLM + StaticCache + SDPA, one decode step compiled."""
        from transformers import StaticCache

        from kvbench.bench.shapes import stock_model
        from kvbench.core.devices import sync
        from kvbench.models import cache_kwargs
        from kvbench.profiling.roofline import phase_costs

        args, device = self.args, self.device
        if self.stock is None:
            self.stock = stock_model(args, device, self.lm.dtype, self.max_positions)
        model = self.stock
        capacity = length + 2 * self.new_tokens + 8  # the eager steps, then the compiled ones
        cache = StaticCache(config=model.config, max_cache_len=capacity)
        kwargs = cache_kwargs(model, cache)
        with torch.inference_mode():
            model(input_ids=torch.tensor([[5]], device=device), position_ids=torch.zeros(1, 1, dtype=torch.long,
                  device=device), use_cache=True, logits_to_keep=1, **kwargs)  # allocates the cache's buffers
            for layer in cache.layers:  # rows 0..L-1 hold random keys and values, as after a prefill
                layer.keys.normal_()
                layer.values.normal_()
                layer.cumulative_length.fill_(length)
        position = [length]

        def step(token: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
            return model(input_ids=token, position_ids=pos, use_cache=True, logits_to_keep=1, **kwargs).logits[0, -1]

        cuda_graphs = device.type == "cuda" and args.backend == "inductor"
        compiled = (torch.compile(step, fullgraph=True, dynamic=False, mode="reduce-overhead") if cuda_graphs
                    else torch.compile(step, fullgraph=True, dynamic=False, backend=args.backend))

        def run(fn, count: int) -> tuple[list[float], float]:
            times = []
            token = torch.tensor([[7]], device=device)
            with torch.inference_mode():
                for i in range(count):
                    pos = torch.tensor([[position[0]]], device=device)
                    if fn is compiled and cuda_graphs:
                        torch.compiler.cudagraph_mark_step_begin()
                    sync(device)
                    t0 = time.perf_counter()
                    logits = fn(token, pos)
                    token = logits.argmax().view(1, 1)
                    sync(device)
                    times.append(1e3 * (time.perf_counter() - t0))
                    position[0] += 1
            return times[args.warmup:], times[0] / 1e3

        eager, _ = run(step, args.warmup + args.steps)
        timed, first_s = run(compiled, args.warmup + args.steps)
        kv = 2 * args.layers * args.kv_heads * args.head_dim * capacity * self.dtype_bytes
        weights = phase_costs(model.config, 0, 0.0, self.dtype_bytes)["decode_bytes_per_step"]
        row = Row(length, "stock")
        row.values.update(eager_ms=statistics.median(eager), eager_p90_ms=percentile(eager, 90),
                          compiled_ms=statistics.median(timed), compiled_p90_ms=percentile(timed, 90),
                          compile_s=max(0.0, first_s - statistics.median(eager) / 1e3), compiles=1, path="compiled",
                          weights_mb=weights / 1e6, kv_aux_mb=kv / 1e6, bytes_mb=(weights + kv) / 1e6,
                          decode_attention="stock_sdpa_static_cache",
                          note=f"StaticCache of {capacity} rows, SDPA, "
                               + ("reduce-overhead" if cuda_graphs else f"backend {args.backend}"))
        cache = kwargs = compiled = None  # the closures above are done: free the cache before the next item
        self.free()
        return row

    def estimate_s(self, length: int, label: str, rows: list[Row]) -> float:
        """Seconds the next item may take: a compile (the median of those seen, or --compile-estimate-s),
        its eager and compiled steps at the pace measured so far at this length, a prefill if none was made."""
        compile_s = statistics.median(self.compile_seen) if self.compile_seen else self.args.compile_estimate_s
        done = [r for r in rows if r.length == length and r.get("eager_ms")]
        step_ms = max((r.get("eager_ms") for r in done), default=50.0)
        prefill = 0.0 if length in self.prefilled else 2.0 + 10.0 * (length / 131072) ** 2
        return compile_s + 2 * (self.args.warmup + self.args.steps) * step_ms / 1e3 + prefill + 2.0

    def free(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def static_rows(session) -> dict[str, Any]:
    """The most tokens a head of the compiled loop holds, and the slots per head of its static view (the capacity,
    `kvbench.cache.static.bucketed`): a step whose scores or masked attention span the view reads the slack
    between the two, which the floor (held rows only) does not count. And where the plan's page or estimate
    dimensions are runtime inputs (`kvbench.methods.common.pages.RuntimePage`, `kvbench.methods.common.dims`),
    the fixed counts the step reads beside the plan's own (`runtime_counts`), which the floor does not count
    either. Empty when the loop did not run static."""
    if not session.cache.is_static:
        return {}
    layers = session.cache.layers
    return {"held_rows": max(int(layer.static.fill.max()) for layer in layers),
            "capacity_rows": max(layer.static.width for layer in layers), "runtime_counts": runtime_counts(layers)}


def runtime_counts(layers) -> str:
    """'pages P for Q, dims m for k': the page bounds the step scores (P, fixed by the capacity) where the plan's
    page needs Q over the same capacity, and the estimate dimensions it takes (m) for the plan's k; '' when the
    step has none of these."""
    derived = next((layer.derived for layer in layers if layer.derived), {})
    pages, keys_t = derived.get("pages"), derived.get("keys_t")
    runtime = getattr(pages, "runtime", None)
    dims = runtime.dims if runtime is not None else getattr(keys_t, "runtime_dims", None)
    parts = []
    if runtime is not None:
        parts.append(f"pages {runtime.pages} for {-(-runtime.width // int(runtime.page))}")
    if dims is not None:
        parts.append(f"dims {dims.count} for {int(dims.value)}")
    return ", ".join(parts)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def add_ratios(rows: list[Row], bench: Bench | None) -> None:
    for row in rows:
        v = row.values
        if bench is not None and v.get("bytes_mb"):
            v["floor_ms"] = bench.floor_ms(v["bytes_mb"] * 1e6)
            if v.get("eager_ms"):
                v["eager_over_floor"] = v["eager_ms"] / v["floor_ms"]
            if v.get("compiled_ms"):
                v["compiled_over_floor"] = v["compiled_ms"] / v["floor_ms"]
        same = {r.method: r for r in rows if r.length == row.length and r.status == "ok"}
        stock, full = same.get("stock"), same.get("full")
        if stock is not None and stock.get("compiled_ms") and v.get("compiled_ms"):
            v["compiled_over_stock"] = v["compiled_ms"] / stock.get("compiled_ms")
        if full is not None and full.get("compiled_ms") and v.get("compiled_ms"):
            v["speedup_vs_full"] = full.get("compiled_ms") / v["compiled_ms"]
            v["baseline_attention"] = full.get("decode_attention")  # what the speedup divides by
        repeated = same.get("full_repeated_kv")  # RocketKV Fig. 7's Full-KV: its released gpt-fast baseline
        if repeated is not None and repeated.get("compiled_ms") and v.get("compiled_ms"):
            v["speedup_vs_repeated_kv"] = repeated.get("compiled_ms") / v["compiled_ms"]
        if full is not None and full.get("bytes_mb") and v.get("bytes_mb"):
            v["full_bytes_over_bytes"] = full.get("bytes_mb") / v["bytes_mb"]
        if v.get("speedup_vs_full") and v.get("full_bytes_over_bytes"):
            v["of_bytes"] = v["speedup_vs_full"] / v["full_bytes_over_bytes"]
        snapkv = same.get("snapkv")
        if snapkv is not None and snapkv.get("compiled_ms") and v.get("compiled_ms"):
            v["compiled_over_snapkv"] = v["compiled_ms"] / snapkv.get("compiled_ms")


def fmt(value: Any, digits: int = 2) -> str:
    if value is None or value == "":
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def print_table(rows: list[Row], bench: Bench | None) -> None:
    if bench is not None:
        print(f"\n{bench.lm.name}: {bench.args.layers} layers, {bench.lm.dtype}, budget {bench.args.budget}, "
              f"{bench.args.steps} timed steps after {bench.args.warmup}; copy rate {bench.gbps:.0f} GB/s; weights "
              f"{bench.weights / 1e6:.0f} MB/step (floor {bench.floor_ms(bench.weights):.3f} ms)")
    print("\n| L | method | eager ms | compiled ms | compile s | MB read/step (KV+aux) | floor ms | eager/floor "
          "| compiled/floor | compiled/stock | speedup vs full | full bytes/bytes | of bytes | compiled/snapkv "
          "| path, note |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for row in rows:
        v = row.values
        if row.status != "ok":
            print(f"| {row.length} | {row.method} | - | - | - | - | - | - | - | - | - | - | - | - | {row.status}"
                  + (f": {v['note']}" if v.get("note") else "") + " |")
            continue
        mb = f"{v['bytes_mb']:.4g} ({v['kv_aux_mb']:.4g})" if v.get("bytes_mb") else "-"
        note = ", ".join(str(x) for x in (v.get("path"), v.get("note")) if x)
        print(f"| {row.length} | {row.method} | {fmt(v.get('eager_ms'))} | {fmt(v.get('compiled_ms'))} "
              f"| {fmt(v.get('compile_s'), 1)} | {mb} | {fmt(v.get('floor_ms'), 3)} | {fmt(v.get('eager_over_floor'))} "
              f"| {fmt(v.get('compiled_over_floor'))} | {fmt(v.get('compiled_over_stock'))} "
              f"| {fmt(v.get('speedup_vs_full'))} | {fmt(v.get('full_bytes_over_bytes'))} | {fmt(v.get('of_bytes'))} "
              f"| {fmt(v.get('compiled_over_snapkv'))} | {note} |")
    spread = [f"{row.length} {row.method} {row.values['compiled_spread']:.1%}" for row in rows
              if row.values.get("compiled_spread") is not None]
    if spread:
        print(f"compiled ms: median of {max(r.values.get('rounds') or 1 for r in rows)} interleaved rounds; spread "
              f"(max - min) / median: {', '.join(spread)}")
    slack = [f"{row.length} {row.method} {row.values['held_rows']}/{row.values['capacity_rows']}" for row in rows
             if row.values.get("capacity_rows") and row.values["capacity_rows"] >= 1.25 * row.values["held_rows"]]
    if slack:  # a CUDA dense step reads each head's held rows only; a selection's scores span the capacity
        print(f"held rows / capacity rows where the capacity is 1.25x or more (slack a step spanning its capacity "
              f"reads beyond the floor's bytes): {', '.join(slack)}")
    for row in rows:
        if row.method == "snapkv" and row.values.get("of_bytes"):
            print(f"L={row.length}: SnapKV, selecting nothing at decode, reaches {row.values['of_bytes']:.2f} of its "
                  "bytes; a method reading as many bytes and selecting at each step reaches at most about that")
    sys.stdout.flush()


def write_csv(path: str, rows: list[Row]) -> None:
    if not path:
        return
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(COLUMNS)
        for row in rows:
            values = {**row.values, "length": row.length, "method": row.method, "status": row.status}
            writer.writerow(["" if values.get(c) is None else values.get(c) for c in COLUMNS])


def merge_rounds(runs: list[Row]) -> None:
    """The first row of an item (the one in the table) holds the median of its rounds' medians, and their spread:
    (max - min) / median."""
    first = runs[0]
    for key in ("eager_ms", "compiled_ms"):
        values = [r.get(key) for r in runs if r.status == "ok" and r.get(key)]
        if values:
            middle = statistics.median(values)
            first.values[key] = middle
            first.values[key.replace("_ms", "_spread")] = (max(values) - min(values)) / middle
    first.values["rounds"] = sum(r.status == "ok" for r in runs)


def work_order(plan: dict[int, list[str]]) -> list[tuple[int, str]]:
    """Each length's first label, then each one's second, ...: a deadline cuts every length's tail, not a length."""
    per_length = [[(length, label) for label in labels] for length, labels in plan.items()]
    return [item for group in itertools.zip_longest(*per_length) for item in group if item is not None]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    elapsed = lambda: time.perf_counter() - start  # noqa: E731

    def on_term(signum, frame):
        raise Deadline()

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        return _main(args, elapsed)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _main(args: argparse.Namespace, elapsed) -> int:
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_compiled_decode: no CUDA device; nothing to do")
        return 0
    import transformers

    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "-"
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"{name}: torch {torch.__version__}, triton {triton_version}, transformers {transformers.__version__}; "
          f"deadline {args.deadline_s:.0f} s", flush=True)
    check_ok = True
    rows: list[Row] = []
    bench = None
    try:
        if args.check:
            check_ok = static_check(args, args.deadline_s - elapsed())
        if args.backend == "inductor":
            import torch._inductor.config as inductor_config

            inductor_config.compile_threads = args.compile_threads
        bench = Bench(args)
        print(f"== (b) eager and compiled decode: {bench.lm.name} ({args.layers} layers, {bench.lm.dtype}) built in "
              f"{bench.build_s:.1f} s, copy rate {bench.gbps:.0f} GB/s, weights {bench.weights / 1e6:.0f} MB/step; "
              f"backend {args.backend}, compile threads {args.compile_threads}", flush=True)
        runs: dict[tuple[int, str], list[Row]] = {}  # every round's row of an item, the first one in `rows`
        for round_, (length, label) in itertools.product(range(args.rounds), work_order(args.plan)):
            first = runs.get((length, label), [None])[0]
            if round_ and (label == "stock" or first is None or first.status != "ok"):
                continue  # later rounds: kvbench's measured items (stock would compile its step again)
            estimate = first.values["seconds"] if round_ else bench.estimate_s(length, label, rows)
            if elapsed() + estimate > args.deadline_s:
                if not round_:
                    rows.append(Row(length, label, "skipped", {"note": f"deadline: {elapsed():.0f} s + "
                                                                        f"~{estimate:.0f} s > {args.deadline_s:.0f} s"}))
                print(f"L={length} {label}: skipped (~{estimate:.0f} s left {args.deadline_s - elapsed():.0f} s)"
                      + (f", round {round_ + 1}" if round_ else ""), flush=True)
                continue
            t0 = time.perf_counter()
            try:
                row = bench.run_stock(length) if label == "stock" else bench.run_method(length, label)
            except Deadline:
                raise
            except Exception as exc:  # noqa: BLE001 - one method's failure is a row, the others still run
                traceback.print_exc()
                row = Row(length, label, "error", {"note": f"{type(exc).__name__}: {str(exc).strip()[:200]}"})
                bench.free()
            row.values["seconds"] = time.perf_counter() - t0
            runs.setdefault((length, label), []).append(row)
            if round_:
                merge_rounds(runs[length, label])
            else:
                rows.append(row)
            v = row.values
            print(f"L={length} {label}: {row.status}, eager {fmt(v.get('eager_ms'))} ms, compiled "
                  f"{fmt(v.get('compiled_ms'))} ms, compile {fmt(v.get('compile_s'), 1)} s, "
                  f"{fmt(v.get('bytes_mb'), 1)} MB/step, {v['seconds']:.0f} s"
                  + (f", prefill {v['prefill_s']:.1f} s" if v.get("prefill_s") else "")
                  + (f" ({v['note']})" if v.get("note") else ""), flush=True)
            add_ratios(rows, bench)
            write_csv(args.csv, rows)
    except Deadline:
        print("\nstopped by SIGTERM", flush=True)
    finally:
        add_ratios(rows, bench)
        write_csv(args.csv, rows)
        print_table(rows, bench)
        print(f"\n{len([r for r in rows if r.status == 'ok'])} of {len(rows)} items measured in {elapsed():.0f} s"
              + (f"; CSV: {args.csv}" if args.csv else ""), flush=True)
        from kvbench.kernels import distinct_rows, group_scores, stable_topk

        for what, module in (("top-k", stable_topk), ("scores", group_scores), ("traffic count", distinct_rows)):
            print(f"selection {what}: {module.FALLBACK.implementation(args.device)}", flush=True)  # or why not
    failed = [f"{r.length} {r.method}" for r in rows if r.status == "error"]
    if failed:
        print(f"errors: {', '.join(failed)}")
    return 0 if check_ok and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
