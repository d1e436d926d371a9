"""The selection methods' stable top-k at their decode shapes, four ways; ratios to what the compiled step ran.

    python scripts/bench_stable_topk.py                          # Llama-3.1-8B's heads, 32K and 128K, budget 1,024
    python scripts/bench_stable_topk.py --device cpu --lengths 300 --kv-heads 2 --group 2 --budget 32 --calls 2  # smoke

Each case is one method's top-k over a static layer at a prompt of `length` tokens and a capacity of
`--capacity-factor` x length (the slack scores at -inf, as a static layer's unused slots are):

- `quest`: the traffic-equivalent pages (page 2 S / t), k2 / page + 2 of them per KV head;
- `quest_page16`: pages of 16 (Quest's release, CTKVR's baseline), k / 16 + 2 per KV head;
- `token_shared`: one token-level top-k per KV head (SparQ's and HSA's shared selections, RocketKV's second stage);
- `token_per_query_head`: one per query head (Exact-TopK's).

Ways, each timed as `--calls` calls (a step's layers) replayed as one CUDA graph:

- `keys_topk`: `stable_topk_reference` eagerly, PyTorch's int64 radix select;
- `keys_topk_inductor`: the same compiled by inductor, what the compiled step ran before the kernel (the ratio's base);
- `float_topk`: `scores.topk(k)`: what the authors' code runs, not stable on ties (a bound for PyTorch's top-k);
- `stable_topk`: the Triton operator (`kvbench.kernels.stable_topk`), the compiled step's choice on CUDA for pages;
- `stable_topk_unordered`: the same without the sort of the k (`ordered=False`), the token-level selections' choice.

Printed: us per call, the ratio to `keys_topk_inductor`, and whether the indices equal the reference's (the
unordered way's in ascending order; the float top-k's need not). Ratios, not claims. The H200 rows of
docs/gpu section 7 are the previous kernel's (a radix select over histograms): compare by the ratio column.
"""

from __future__ import annotations

import argparse
import os

import torch

from kvbench.bench.shapes import topk_cases
from kvbench.bench.timing import timed

WAYS = ("keys_topk", "keys_topk_inductor", "float_topk", "stable_topk", "stable_topk_unordered")


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="float32", choices=["bfloat16", "float16", "float32"],
                        help="the scores' dtype (the methods score in fp32)")
    parser.add_argument("--lengths", default="32768,131072")
    parser.add_argument("--capacity-factor", type=float, default=1.25)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--calls", type=int, default=8, help="calls per timed replay (a step's layers)")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # the kernel runs interpreted (a smoke run, no timing claim)
    from kvbench.kernels._stable_topk_kernels import launch_stable_topk
    from kvbench.kernels.stable_topk import stable_topk_reference

    compiled = torch.compile(stable_topk_reference, dynamic=False, fullgraph=True,
                             backend="inductor" if device.type == "cuda" else "eager")
    ways = {
        "keys_topk": stable_topk_reference,
        "keys_topk_inductor": compiled,
        "float_topk": lambda scores, k: scores.topk(k, dim=-1).indices,
        # the launch itself: on CUDA the operator runs it, and on the CPU the operator would take the reference
        "stable_topk": launch_stable_topk,
        "stable_topk_unordered": lambda scores, k: launch_stable_topk(scores, k, ordered=False),
    }
    print(f"device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}; torch {torch.__version__}; "
          f"{args.kv_heads} KV heads x group {args.group}, budget {args.budget}, capacity {args.capacity_factor} x "
          f"length, {args.dtype} scores, {args.calls} calls per replay")
    print("| length | case | rows x L | k | way | us / call | x keys_topk_inductor | equal |")
    print("|---:|---|---|---:|---|---:|---:|---|")
    rows_out = []
    for length in (int(x) for x in args.lengths.split(",")):
        capacity = max(length, int(length * args.capacity_factor))
        for case, rows, width, k in topk_cases(length, capacity, args.budget, args.kv_heads, args.group):
            gen = torch.Generator().manual_seed(width + k)
            held = width * length // capacity
            scores = [torch.full((rows, width), float("-inf"), dtype=dtype) for _ in range(args.calls)]
            for s in scores:  # a page's or a token's score; ties are rare in fp32 scores, as in the methods'
                s[:, :held] = torch.randn(rows, held, generator=gen).to(dtype)
            scores = [s.to(device) for s in scores]
            want = stable_topk_reference(scores[-1], k)
            timings = {}
            for way in WAYS:
                fn, outs = ways[way], {}

                def run(fn=fn, outs=outs):
                    for s in scores:
                        outs["last"] = fn(s, k)

                expected = want.sort(dim=-1).values if way == "stable_topk_unordered" else want
                timings[way] = (timed(run, device, args.repeats) / args.calls,
                                torch.equal(outs["last"].cpu(), expected.cpu()))
            for way, (seconds, equal) in timings.items():
                rows_out.append({"length": length, "case": case, "rows": rows, "width": width, "k": k, "way": way,
                                 "us": 1e6 * seconds, "equal": equal})
                print(f"| {length} | {case} | {rows} x {width} | {k} | {way} | {1e6 * seconds:.1f} | "
                      f"{seconds / timings['keys_topk_inductor'][0]:.2f} | {'yes' if equal else 'no'} |", flush=True)
    return rows_out


if __name__ == "__main__":
    main()
