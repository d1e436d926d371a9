"""The one decode attention alone, against the time its K/V bytes cost at this machine's read rate.

    python scripts/bench_decode_attention.py                          # SmolLM2 shapes, bf16, on this machine
    python scripts/bench_decode_attention.py --dtype float32
    python scripts/bench_decode_attention.py --kv-heads 8 --group 4 --head-dim 128 --layers 32   # Llama-3.1-8B

For each row count, `--layers` layers of flat K/V row buffers (as the cache holds them: heads strided by a
capacity with decode slack) are attended one after the other by `kernels.decode_attention`, so every layer's
K/V comes from memory, not from a cache level, as in a real step. Printed per row count: microseconds per
layer, the K/V bytes one layer reads, the floor those bytes cost at the stream rate (`torch.sum` over a large
buffer, measured in the same run) and the ratio, and the same for a plain `sum` over that layer's K and V
(what streaming the bytes costs at all). `bench_decode_latency.py` times whole steps; this isolates the
attention kernel's share: a ratio well above the `sum`'s is the kernel, not the harness or the method.

With a GQA group above 1, it also times stock SDPA's GQA call (`enable_gqa`, the call transformers makes and
the float32 path keeps for bitwise equality) against the same attention with the group as query rows of one
KV head, and says whether the two are bitwise equal.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from kvbench.bench.timing import stream_bandwidth
from kvbench.core.devices import sync
from kvbench.kernels.decode_attention import decode_attention
from kvbench.models import resolve_device


def time_layers(fn, layers: int, device: torch.device, repeats: int) -> float:
    """Median seconds per layer of `fn(i)` run over layers 0 .. layers - 1, `repeats` times, after one pass."""
    for i in range(layers):
        fn(i)
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        for i in range(layers):
            fn(i)
        sync(device)
        times.append((time.perf_counter() - start) / layers)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--rows", default="256,1024,8064", help="cached rows per KV head, comma-separated")
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--group", type=int, default=3, help="query heads per KV head")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--slack", type=int, default=64, help="free rows after each head (the decode reservation)")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    device, dtype = resolve_device(args.device), getattr(torch, args.dtype)
    heads, dim = args.kv_heads, args.head_dim
    rate = stream_bandwidth(dtype) if device.type == "cpu" else None
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(heads, args.group, dim, generator=gen, device=device).to(dtype)
    print(f"decode attention on {device}, {dtype}, {heads} KV heads x {args.group} queries, head dim {dim}, "
          f"{args.layers} layers" + (f", stream rate {rate / 1e9:.1f} GB/s" if rate else ""))
    print(f"{'rows':>6} {'KV MB/layer':>12} {'attention us':>13} {'floor us':>9} {'ratio':>6} {'sum us':>7} {'ratio':>6}")
    for rows in (int(r) for r in args.rows.split(",")):
        cap = rows + args.slack
        keys, values = ([torch.randn(heads * cap, dim, generator=gen, device=device).to(dtype)
                         for _ in range(args.layers)] for _ in range(2))
        starts, lens, caps = [h * cap for h in range(heads)], [rows] * heads, [cap] * heads
        scaling = dim ** -0.5
        with torch.inference_mode():
            attention = time_layers(lambda i: decode_attention(q, keys[i], values[i], scaling, starts, lens, caps),
                                    args.layers, device, args.repeats)
            read = time_layers(lambda i: (keys[i].view(heads, cap, dim)[:, :rows].sum(),
                                          values[i].view(heads, cap, dim)[:, :rows].sum()),
                               args.layers, device, args.repeats)
        nbytes = 2 * heads * rows * dim * keys[0].element_size()
        floor = nbytes / rate if rate else float("nan")
        print(f"{rows:>6} {nbytes / 1e6:>12.2f} {1e6 * attention:>13.0f} {1e6 * floor:>9.0f} {attention / floor:>6.2f} "
              f"{1e6 * read:>7.0f} {read / floor:>6.2f}")
        if args.group > 1:
            gqa_as_rows(q, keys[0].view(heads, cap, dim)[:, :rows], values[0].view(heads, cap, dim)[:, :rows],
                        scaling, device, args.repeats)


def gqa_as_rows(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float, device: torch.device,
                repeats: int) -> None:
    """Print stock SDPA with `enable_gqa` [1, H*G, 1, D] against SDPA with queries [1, H, G, D]."""
    heads, group, dim = q.shape
    calls = {"enable_gqa": lambda: F.scaled_dot_product_attention(q.reshape(1, -1, 1, dim), keys[None], values[None],
                                                                  scale=scaling, enable_gqa=True).view(q.shape),
             "group as rows": lambda: F.scaled_dot_product_attention(q[None], keys[None], values[None],
                                                                     scale=scaling)[0]}
    with torch.inference_mode():
        outs = {name: call() for name, call in calls.items()}
        times = {name: time_layers(lambda i, call=call: call(), 1, device, repeats) for name, call in calls.items()}
    print(f"{'':>6} SDPA enable_gqa {1e6 * times['enable_gqa']:.0f} us, group as query rows "
          f"{1e6 * times['group as rows']:.0f} us, bitwise equal: {torch.equal(*outs.values())}")


if __name__ == "__main__":
    main()
