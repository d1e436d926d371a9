"""A sweep's points of one sample decoded one by one and as one batch (issue 66's GPU phase): ms per row-token
against the floor, and whether the GPU's kernels are batch-invariant (the probe a run makes before batching).

    python scripts/gpu_batched_decode.py                      # Llama-3.1-8B shapes, 8 layers, bf16, 32K, 16 points
    python scripts/gpu_batched_decode.py --device cpu --dtype float32 --layers 1 --hidden 64 --intermediate 128 \\
        --heads 4 --kv-heads 2 --head-dim 16 --length 256 --budgets 32,64 --backend eager   # CPU smoke test

The random Llama-3.1-8B-shaped model of scripts/gpu_compiled_decode.py (`kvbench.bench.shapes`), one random
prompt of `--length` tokens prefilled once (dense, `engine.reuse_prefill`'s snapshot) and compressed by every point
from it, as a grouped sweep does. The points: full attention, then each of `--methods` at each of `--budgets`
(16 by default: full, SnapKV, Ada-KV and Quest at 256 to 2,048 tokens, and SnapKV and Quest at 4,096).

1. The probe (`kvbench.engine.invariance.batch_invariance`) at the batch's row count and row block, on this device
   and dtype: None, or why a run would decode one row at a time here.
2. One by one: each point decodes alone (`decode_batch` with one session: the eager step padded to the row block,
   what a run does), `--warmup` untimed and `--steps` timed steps.
3. Batched: every point in one `decode_batch` of `--batch-rows` rows per forward (the grouped launcher's path), the
   same steps; its time per step is shared by the rows.
4. Compiled, one by one (`--compiled`, the first points that fit `--deadline-s`): each point through the compiled
   step (`engine.compile`), as a GPU run decodes it today (compiled rows step alone; a compiled step with a row
   dimension is not built).

The floor of a forward is the bytes it must read over the copy rate measured here (`kvbench.bench.timing.copy_gbps`):
the weights once plus every row's K/V and auxiliary elements (`kvbench.bench.timing.step_read_bytes`).
Per row-token: one by one, each point's (weights + its bytes) summed over the points and divided by them; batched,
(weights + all rows' bytes) per step divided by the rows. Printed as ratios (one by one / batched, each over its
floor), and with `--csv` as rows. Equal tokens one by one and batched are checked (a difference is printed).
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time

import torch

DEFAULT_METHODS = "snapkv,adakv,quest"
COLUMNS = ["mode", "rows", "ms_per_step", "ms_per_row_token", "floor_ms_per_row_token", "over_floor", "bytes_mb",
           "weights_mb", "probe", "tokens_equal", "note"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from kvbench.bench.shapes import add_shape_arguments

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda, or cpu (only to test this script, tiny shapes)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    add_shape_arguments(parser, layers=8)
    parser.add_argument("--length", type=int, default=32768, help="prompt tokens")
    parser.add_argument("--methods", default=DEFAULT_METHODS, help="methods beside full, each at every budget")
    parser.add_argument("--budgets", default="256,512,1024,2048", help="tokens per KV group, comma-separated")
    parser.add_argument("--extra", default="snapkv@4096,quest@4096", help="more points: method@budget, comma-separated")
    parser.add_argument("--batch-rows", type=int, default=16, help="rows per batched forward (engine.batch_rows)")
    parser.add_argument("--row-block", type=int, default=None, help="default: engine.row_block=auto on the device")
    parser.add_argument("--steps", type=int, default=16, help="timed decode steps per point")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    parser.add_argument("--compiled", type=int, default=4, help="points decoded compiled one by one (0: none)")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend: inductor, or eager/aot_eager")
    parser.add_argument("--deadline-s", type=float, default=150.0, help="start no compiled point past this many s")
    parser.add_argument("--csv", default="batched_decode.csv", help="where to write the rows ('' for nowhere)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    budgets = [int(b) for b in args.budgets.split(",")]
    args.points = [("full", None)] + [(m, b) for m in args.methods.split(",") if m for b in budgets]
    args.points += [(item.split("@")[0], int(item.split("@")[1])) for item in args.extra.split(",") if item]
    return args


class Sweep:
    """The model, the shared prefill, and sessions compressed from it for each point."""

    def __init__(self, args: argparse.Namespace):
        from kvbench.bench.shapes import random_model_cfg
        from kvbench.bench.timing import copy_gbps
        from kvbench.engine.config import EngineConfig
        from kvbench.engine.snapshots import PrefillSnapshots
        from kvbench.models import load_model
        from kvbench.profiling.roofline import phase_costs

        self.args = args
        self.device = torch.device(args.device)
        self.new_tokens = args.warmup + args.steps + 1
        with torch.device(self.device):  # random init on the device
            self.lm = load_model(random_model_cfg(args, max(4096, args.length + 2 * self.new_tokens + 64)))
        self.dtype_bytes = torch.finfo(self.lm.dtype).bits // 8
        self.weights = phase_costs(self.lm.model.config, 0, 0.0, self.dtype_bytes)["decode_bytes_per_step"]
        self.gbps = copy_gbps(self.device)
        self.engine = EngineConfig(reuse_prefill=True, snapshot_cache_mb=1 << 17)
        self.row_block = args.row_block or self.engine.resolved_row_block(self.device)
        self.snapshots = PrefillSnapshots(self.engine.snapshot_cache_mb)
        gen = torch.Generator().manual_seed(args.seed)
        self.ids = torch.randint(4, self.lm.model.config.vocab_size, (args.length,), generator=gen).tolist()

    def session(self, name: str, budget: int | None):
        from kvbench.engine.sample import _prefill_segment, sample_generator
        from kvbench.methods import build_method

        method = build_method(name)
        plan = method.plan(budget if budget is not None else self.args.length, sequence_length=self.args.length
                           + self.new_tokens, new_tokens=self.new_tokens, head_dim=self.args.head_dim)
        session, logits, *_ = _prefill_segment(self.lm, method, plan, self.ids, self.engine, self.snapshots,
                                               sample_generator(self.args.seed, "sweep"))
        session.row_block = self.row_block
        return session, logits

    def floor_ms(self, nbytes: float) -> float:
        return nbytes / (self.gbps * 1e9) * 1e3


def decode_timed(sweep: Sweep, sessions: list, logits: list, max_rows: int) -> tuple[list[list[int]], float]:
    """`decode_batch` of `sessions` for warmup + steps tokens: the tokens, and the median ms of a timed forward
    (each row's share times the rows)."""
    from kvbench.engine.session import decode_batch

    n, args = len(sessions), sweep.args
    decoded = decode_batch(sessions, logits, [sweep.new_tokens] * n, set(), [[]] * n, [sweep.new_tokens] * n,
                           max_rows)
    per_step = [sum(times) for times in zip(*[steps[args.warmup:] for _, steps, _ in decoded])]
    return [tokens for tokens, _, _ in decoded], 1e3 * statistics.median(per_step)


def main(argv: list[str] | None = None) -> int:
    from kvbench.bench.timing import step_read_bytes
    from kvbench.engine.compiled import decoder_for
    from kvbench.engine.invariance import batch_invariance

    args = parse_args(argv)
    start = time.perf_counter()
    sweep = Sweep(args)
    rows_n = len(args.points)
    max_rows = min(rows_n, args.batch_rows)
    probe = batch_invariance(sweep.lm, max_rows, sweep.row_block)
    print(f"{args.device} {args.dtype}, {args.layers} layers, prompt {args.length}, {rows_n} points, "
          f"batch_rows {max_rows}, row block {sweep.row_block}, copy {sweep.gbps:.0f} GB/s")
    print(f"probe: {probe or 'batch-invariant (a row alone and in every batch: the same bits)'}")
    out = []

    alone_tokens, alone_ms, alone_bytes = [], [], []
    for name, budget in args.points:
        session, logits = sweep.session(name, budget)
        tokens, ms = decode_timed(sweep, [session], [logits], 1)
        alone_tokens.append(tokens[0])
        alone_ms.append(ms)
        alone_bytes.append(step_read_bytes(session, sweep.dtype_bytes))
        del session, logits
    one_floor = sum(sweep.floor_ms(sweep.weights + b) for b in alone_bytes) / rows_n
    one = sum(alone_ms) / rows_n
    out.append({"mode": "one_by_one", "rows": 1, "ms_per_step": one, "ms_per_row_token": one,
                "floor_ms_per_row_token": one_floor, "over_floor": one / one_floor,
                "bytes_mb": (sweep.weights * rows_n + sum(alone_bytes)) / 1e6 / rows_n, "weights_mb": sweep.weights / 1e6,
                "probe": probe or "invariant", "tokens_equal": None, "note": "eager, each point padded to the row block"})

    pairs = [sweep.session(name, budget) for name, budget in args.points]
    tokens, ms = decode_timed(sweep, [s for s, _ in pairs], [lg for _, lg in pairs], max_rows)
    total_bytes = sum(step_read_bytes(s, sweep.dtype_bytes) for s, _ in pairs)
    forwards = -(-rows_n // max_rows)
    floor = sweep.floor_ms(forwards * sweep.weights + total_bytes) / rows_n
    equal = sum(a == b for a, b in zip(alone_tokens, tokens))
    out.append({"mode": "batched", "rows": max_rows, "ms_per_step": ms, "ms_per_row_token": ms / rows_n,
                "floor_ms_per_row_token": floor, "over_floor": ms / rows_n / floor,
                "bytes_mb": (forwards * sweep.weights + total_bytes) / 1e6, "weights_mb": sweep.weights / 1e6,
                "probe": probe or "invariant", "tokens_equal": f"{equal}/{rows_n}",
                "note": f"eager, {forwards} forward(s) of up to {max_rows} rows per step"})
    del pairs

    decoder = decoder_for(sweep.lm, args.backend) if args.compiled else None
    compiled_ms, compiled_floor = [], []
    for i, (name, budget) in enumerate(args.points[:args.compiled]):
        if time.perf_counter() - start > args.deadline_s:
            print(f"compiled: stopped after {i} points (--deadline-s {args.deadline_s:.0f})")
            break
        session, logits = sweep.session(name, budget)
        session.decoder = decoder
        tokens, ms = decode_timed(sweep, [session], [logits], 1)
        if session.decode_path != "compiled":
            print(f"compiled: {name}@{budget} ran {session.decode_path}: {session.decode_path_reason}")
            continue
        compiled_ms.append(ms)
        compiled_floor.append(sweep.floor_ms(sweep.weights + step_read_bytes(session, sweep.dtype_bytes)))
        del session, logits
    if compiled_ms:
        n = len(compiled_ms)
        one_compiled = sum(compiled_ms) / n
        out.append({"mode": "compiled_one_by_one", "rows": 1, "ms_per_step": one_compiled,
                    "ms_per_row_token": one_compiled, "floor_ms_per_row_token": sum(compiled_floor) / n,
                    "over_floor": one_compiled / (sum(compiled_floor) / n), "bytes_mb": None,
                    "weights_mb": sweep.weights / 1e6, "probe": probe or "invariant", "tokens_equal": None,
                    "note": f"the first {n} points, each alone (compile time excluded: warmup steps)"})

    print(f"\n{'mode':<22}{'rows':>5}{'ms/step':>10}{'ms/row-token':>14}{'floor':>9}{'x floor':>9}  tokens")
    for row in out:
        print(f"{row['mode']:<22}{row['rows']:>5}{row['ms_per_step']:>10.3f}{row['ms_per_row_token']:>14.3f}"
              f"{row['floor_ms_per_row_token']:>9.3f}{row['over_floor']:>9.2f}  {row['tokens_equal'] or '-'}")
    print(f"batched over one by one, per row-token: {out[0]['ms_per_row_token'] / out[1]['ms_per_row_token']:.2f}x "
          f"(floors allow {out[0]['floor_ms_per_row_token'] / out[1]['floor_ms_per_row_token']:.2f}x)")
    if equal != rows_n:
        print(f"tokens differ batched vs alone at {rows_n - equal} of {rows_n} points")
    if args.csv:
        with open(args.csv, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=COLUMNS)
            writer.writeheader()
            writer.writerows(out)
    return 0 if equal == rows_n or probe is not None else 1


if __name__ == "__main__":
    sys.exit(main())
