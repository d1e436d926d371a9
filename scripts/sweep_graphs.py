"""How many graphs a sweep over prompt lengths compiles for each selection method whose plan derives shapes from
the length, and what reading the runtime counts costs: arithmetic over the methods' own plans and the static
layout's rules (no model is loaded, nothing is compiled).

    python scripts/sweep_graphs.py                                  # 200 lengths of 2K-31K tokens (LongBench-like)
    python scripts/sweep_graphs.py --budgets 256,1024 --head-dim 128 --samples 500 --max-length 120000

A compiled decode step is one graph per layout shape (`kvbench.engine.compiled`). Quest's page, HSA's and
RocketKV's page and estimate dimensions and SparQ's r are functions of the length the plan was made for; the
static step takes them as runtime inputs (`kvbench.methods.common.pages.RuntimePage`,
`kvbench.methods.common.dims`), so a sweep compiles one graph per capacity the loops fall in. Printed per method
and budget: `graphs` (distinct capacities: what it compiles), `as shapes` (distinct capacities and plan numbers:
what it would compile were the numbers graph constants, as they were), and the estimate's elements read per KV
head and step with the runtime counts over those with the plan's own numbers at the same capacity (median and
largest over the lengths): the price of the fixed counts. tests/test_capacity_buckets.py compiles a 12-length
sweep with dynamo to check the counts this arithmetic gives.
"""

from __future__ import annotations

import argparse
import random
import statistics

import torch

from kvbench.cache.static import bucketed
from kvbench.methods import build_method
from kvbench.methods.common.dims import RuntimeDims
from kvbench.methods.common.pages import RuntimePage
from kvbench.methods.hsa import HSALength
from kvbench.methods.quest import QuestPage
from kvbench.methods.sparq import SparQDims

METHODS = ("quest", "hsa", "rocketkv", "sparq")
CPU = torch.device("cpu")


def loop_shapes(method: str, budget: int, length: int, new_tokens: int, head_dim: int):
    """(capacity W, the plan's numbers, estimate elements with the plan's numbers, with the runtime counts) of a
    point's decode loop, or None where the budget is full attention."""
    plan = build_method(method).plan(budget, sequence_length=length, new_tokens=new_tokens, head_dim=head_dim)
    if not plan.select:
        return None
    d = plan.derived
    rows = d.get("capacity", length)  # RocketKV's loop holds its stage-1 capacity, the others every token
    width = bucketed(rows + 1)
    if method == "sparq":
        dims = RuntimeDims.at(d["r"], SparQDims(budget, head_dim, d["r"]).most_dims(width // 2, width), CPU)
        return width, (d["r"],), d["r"] * width, dims.count * width
    if method == "quest":
        rule, dims = QuestPage(budget, d["k2"]), head_dim
    else:
        rule, dims = HSALength(budget, d["k2"], head_dim, d["k1"]), d["k1"]
    runtime = RuntimePage.at(width, d["page_size"], rule, CPU)
    count = runtime.dims.count if runtime.dims is not None else dims
    return width, (d["page_size"], dims), -(-width // d["page_size"]) * dims, runtime.pages * count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budgets", default="256,1024,2048,4096")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--samples", type=int, default=200, help="prompt lengths, drawn uniformly")
    parser.add_argument("--min-length", type=int, default=2000)
    parser.add_argument("--max-length", type=int, default=31000)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    draw = random.Random(args.seed)
    lengths = [draw.randint(args.min_length, args.max_length) + args.new_tokens for _ in range(args.samples)]
    print(f"{args.samples} prompt lengths of {args.min_length}-{args.max_length} tokens + {args.new_tokens} new, "
          f"head dim {args.head_dim}")
    print(f"{'method':10s} {'budget':>6s} {'points':>6s} {'graphs':>6s} {'as shapes':>9s} "
          f"{'estimate read x median':>22s} {'largest':>7s}")
    for budget in (int(b) for b in args.budgets.split(",")):
        for method in args.methods.split(","):
            loops = [s for s in (loop_shapes(method, budget, n, args.new_tokens, args.head_dim) for n in lengths) if s]
            if not loops:
                print(f"{method:10s} {budget:6d} {0:6d}  (the budget covers every length: full attention)")
                continue
            ratios = [runtime / planned for _, _, planned, runtime in loops]
            print(f"{method:10s} {budget:6d} {len(loops):6d} {len({w for w, *_ in loops}):6d} "
                  f"{len({(w, numbers) for w, numbers, *_ in loops}):9d} {statistics.median(ratios):22.2f} "
                  f"{max(ratios):7.2f}")


if __name__ == "__main__":
    main()
