"""A decode step's weight products, the projections of one input separate or stacked (`models.pack_projections`).

    python scripts/bench_stacked_projections.py                  # Llama-3.1-8B's widths, 8 layers, bf16, CUDA
    python scripts/bench_stacked_projections.py --device cpu --layers 2 --hidden 64 --intermediate 128 \\
        --heads 4 --kv-heads 2 --head-dim 16 --repeats 2          # smoke

Each layer is the seven linear layers (query, key, value, output; gate, up, down) of a stock transformers
Llama block with random weights (`kvbench.bench.shapes.stock_model`), one token's activations through them as a
decode step runs them. `separate`: seven products a layer,
as stock transformers runs them; `stacked`: the same modules after `pack_projections`, as `load_model` leaves a
CUDA model in 16-bit floats (the query, key and value weights one product, the gate and up weights one: four a
layer). Timed as one step's layers replayed as one CUDA graph (`kvbench.bench.timing.timed`). Printed: us per
step and per layer, the ratio to `separate`, the weights' bytes over that time against the measured copy rate
(`kvbench.bench.timing.copy_gbps`), and the largest difference of the outputs (16-bit sums split otherwise can
round otherwise). Docs/gpu section 7's breakdown put these products at about 1.03 ms of a step of 8 layers.
"""

from __future__ import annotations

import argparse
import copy
import os

import torch

from kvbench.bench.shapes import add_shape_arguments, stock_model
from kvbench.bench.timing import copy_gbps, timed


def step(blocks: list[torch.nn.Module], x: torch.Tensor) -> torch.Tensor:
    """One token through every decoder layer's products, in a decode step's order (attention and MLP arithmetic
    left out: each product's input is the previous one's output, cut or padded to its width)."""
    for block in blocks:
        attn, mlp = block.self_attn, block.mlp
        q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        x = x + attn.o_proj(q + torch.nn.functional.pad(k + v, (0, q.shape[-1] - k.shape[-1])))
        x = x + mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    return x


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    add_shape_arguments(parser, layers=8)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from kvbench.models import PackedProduct, pack_projections, weight_products

    separate = list(stock_model(args, device, dtype).model.layers)
    stacked = copy.deepcopy(separate)
    for block in stacked:
        pack_projections(block)
    assert sum(isinstance(m, PackedProduct) for b in stacked for m in b.modules()) == 2 * args.layers
    weights = sum(nbytes for block in separate for _, nbytes in weight_products(block))
    gbps = copy_gbps(device)
    x = torch.randn(1, 1, args.hidden, generator=torch.Generator(device=device).manual_seed(0), device=device,
                    dtype=dtype) * 0.1
    print(f"device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}; torch {torch.__version__}; "
          f"{args.layers} layers of hidden {args.hidden}, MLP {args.intermediate}, {args.heads} query and "
          f"{args.kv_heads} KV heads of {args.head_dim}; {args.dtype}; weights {weights / 1e6:.4g} MB a step; copy "
          f"rate {gbps:.0f} GB/s (floor {weights / gbps / 1e3:.1f} us a step)")
    print("| way | products a layer | us / step | us / layer | x separate | weights GB/s | of copy rate | max |diff| |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    reference = step(separate, x)
    rows, base = [], None
    with torch.inference_mode():
        for way, blocks, products in (("separate", separate, 7), ("stacked", stacked, 4)):
            outs = {}

            def run(blocks=blocks, outs=outs):
                outs["last"] = step(blocks, x)

            seconds = timed(run, device, args.repeats)
            base = base or seconds
            diff = float((outs["last"].float() - reference.float()).abs().max())
            rate = weights / seconds / 1e9
            rows.append({"way": way, "us": 1e6 * seconds, "ratio": seconds / base, "gbps": rate, "diff": diff})
            print(f"| {way} | {products} | {1e6 * seconds:.1f} | {1e6 * seconds / args.layers:.1f} | "
                  f"{seconds / base:.3f} | {rate:.0f} | {rate / gbps:.2f} | {diff:.3g} |", flush=True)
    return rows


if __name__ == "__main__":
    main()
