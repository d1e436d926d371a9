"""Dense decode attention over the static layout, four ways, against the time its K/V bytes cost on this GPU.

    python scripts/bench_flash_decode.py                                   # Llama-3.1-8B shapes, bf16, 32K and 128K
    python scripts/bench_flash_decode.py --lengths 4096 --slack 2.0 --layers 4
    python scripts/bench_flash_decode.py --device cpu --lengths 200 --kv-heads 2 --head-dim 16 --layers 2  # smoke

Each layer is a static layer as the compiled decode step holds it: `--kv-heads` heads of `--capacity-factor` x
length rows each (the geometric capacity series leaves up to 2x; slack rows are zeros, as the cache's are), the
first `length` held. `--layers` such layers are attended one after the other (each from HBM,
not from L2), and every way is timed as one CUDA graph replay of all layers (no launch overhead in the numbers):

- `flash_decode`: kvbench's split-K Triton operator (`kvbench.kernels.flash_decode`), the compiled step's choice;
- `padded_inductor`: the PyTorch static attention over the whole capacity, masked, compiled by inductor (what
  the compiled step ran before the kernel: ~9x its floor on an H100 at 32K, docs/gpu);
- `flex_attention`: PyTorch's flex attention (compiled; GQA; a block mask over the held rows, built once
  outside the timing: a decode loop would rebuild it at every step as the lengths grow, `flex_mask_ms`);
- `sdpa_exact`: stock SDPA (flash backend) over exactly the held rows of a contiguous layer: no static layout;
  what the bytes cost with PyTorch's own best kernel.

With `--selected K`, two more ways attend to K slots per KV group drawn from the held rows (a selection
method's step: Quest's pages, RocketKV's HSA), against the floor of those K rows' bytes:

- `selected_flash`: the indexed operator (`kernels.flash_decode.flash_decode_selected`), the compiled step's
  choice on CUDA;
- `selected_inductor`: `topk_attention_traced` (rows gathered, fp32 products) compiled by inductor, what the
  compiled step ran before.

Printed: ms per layer, the effective K/V read rate, and the ratio to the floor (the held K/V bytes at the
device copy rate measured here, bytes read plus written, as the field report counts it). Ratios, not claims.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from kvbench.bench.timing import copy_gbps, timed
from kvbench.core.devices import sync


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--lengths", default="32768,131072")
    parser.add_argument("--capacity-factor", type=float, default=1.5, help="capacity rows / held rows per head")
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--ways", default="flash_decode,padded_inductor,flex_attention,sdpa_exact")
    parser.add_argument("--selected", type=int, default=0, help="slots per KV group of the selected ways (0: none)")
    args = parser.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # the kernel runs interpreted (a smoke run, no timing claim)
    from kvbench.kernels.decode_attention import static_decode_attention
    from kvbench.kernels.flash_decode import flash_decode, flash_decode_selected
    from kvbench.kernels.sparse_attention import topk_attention_traced

    rate = 1e9 * copy_gbps(device)  # bytes per second, read plus written
    print(f"device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}; torch {torch.__version__};"
          f" copy rate {rate / 1e9:.0f} GB/s (read + written); {args.layers} layers of {args.kv_heads} KV heads x "
          f"group {args.group} x dim {args.head_dim}, {args.dtype}, capacity {args.capacity_factor} x length")
    ways = args.ways.split(",") + (["selected_flash", "selected_inductor"] if args.selected else [])
    if device.type == "cpu":
        ways = [w for w in ways if w in ("flash_decode", "padded_inductor", "selected_flash", "selected_inductor")]
    padded = torch.compile(static_decode_attention, dynamic=False, fullgraph=True,
                           backend="inductor" if device.type == "cuda" else "eager")
    rows_out = []
    print("| length | way | ms / layer | K/V GB/s | x floor | max abs diff |")
    print("|---:|---|---:|---:|---:|---:|")
    for length in (int(x) for x in args.lengths.split(",")):
        n_kv, group, dim = args.kv_heads, args.group, args.head_dim
        cap = max(length, int(length * args.capacity_factor))
        gen = torch.Generator(device="cpu").manual_seed(length)
        layers = []
        for _ in range(args.layers):
            keys = torch.zeros((n_kv, cap, dim), dtype=dtype, device=device)
            values = torch.zeros_like(keys)
            keys[:, :length] = torch.randn(n_kv, length, dim, generator=gen).to(device, dtype)
            values[:, :length] = torch.randn(n_kv, length, dim, generator=gen).to(device, dtype)
            layers.append((keys.view(-1, dim), values.view(-1, dim)))
        q = torch.randn(n_kv, group, dim, generator=gen).to(device, dtype)
        starts = torch.arange(n_kv, device=device) * cap
        fill = torch.full((n_kv,), length, dtype=torch.int64, device=device)
        scale = dim ** -0.5
        floor_s = 2 * n_kv * length * dim * keys.element_size() / rate
        # each way keeps its last layer's output
        exact_k, exact_v = (t.view(n_kv, cap, dim)[:, :length].contiguous() for t in layers[-1])
        ref = torch.softmax(torch.einsum("hgd,hld->hgl", q.float(), exact_k.float()) * scale, -1)
        ref = torch.einsum("hgl,hld->hgd", ref, exact_v.float())
        outs: dict[str, torch.Tensor] = {}

        def run_flash():
            for k, v in layers:
                outs["flash_decode"] = flash_decode(q, k, v, starts, fill, scale)

        def run_padded():
            for k, v in layers:
                outs["padded_inductor"] = padded(q, k, v, scale, fill, cap, None, None)

        run = {"flash_decode": run_flash, "padded_inductor": run_padded}
        extra, floors, refs = {}, {}, {}
        if args.selected:
            picked = min(args.selected, length)
            slots = torch.stack([torch.randperm(length, generator=gen)[:picked].sort().values for _ in range(n_kv)])
            slots = slots.to(device)[:, None, :].expand(n_kv, group, picked)  # one selection per KV group
            traced = torch.compile(topk_attention_traced, dynamic=False, fullgraph=True,
                                   backend="inductor" if device.type == "cuda" else "eager")
            views = [tuple(t.view(n_kv, cap, dim) for t in kv) for kv in layers]
            for way in ("selected_flash", "selected_inductor"):
                floors[way] = 2 * n_kv * picked * dim * keys.element_size() / rate
                refs[way] = sparse_reference(q, *views[-1], slots, scale)

            def run_selected_flash():
                for k, v in layers:
                    outs["selected_flash"] = flash_decode_selected(q, k, v, starts, fill, slots, scale)

            def run_selected_inductor():
                for k, v in views:
                    outs["selected_inductor"] = traced(q, k, v, slots, scale)

            run.update(selected_flash=run_selected_flash, selected_inductor=run_selected_inductor)
        if "sdpa_exact" in ways:
            contiguous = [tuple(t.view(n_kv, cap, dim)[:, :length].contiguous()[None] for t in kv) for kv in layers]
            qs = q.reshape(1, n_kv * group, 1, dim)

            def run_sdpa():
                from torch.nn.attention import SDPBackend, sdpa_kernel

                with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
                    for k, v in contiguous:
                        outs["sdpa_exact"] = torch.nn.functional.scaled_dot_product_attention(
                            qs, k, v, scale=scale, enable_gqa=True).view(n_kv, group, dim)

            run["sdpa_exact"] = run_sdpa
        if "flex_attention" in ways:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            flex = torch.compile(flex_attention, dynamic=False, fullgraph=True)
            qf = q.reshape(1, n_kv * group, 1, dim)
            held = fill  # the held rows of each KV head
            def mask_mod(b, h, q_idx, kv_idx):
                return kv_idx < held[h // group]

            t = time.perf_counter()
            block_mask = create_block_mask(mask_mod, 1, n_kv * group, 1, cap, device=device)
            sync(device)
            extra["flex_mask_ms"] = 1e3 * (time.perf_counter() - t)
            views = [tuple(t.view(1, n_kv, cap, dim) for t in kv) for kv in layers]

            def run_flex():
                for k, v in views:
                    outs["flex_attention"] = flex(qf, k, v, block_mask=block_mask,
                                                  scale=scale, enable_gqa=True).view(n_kv, group, dim)

            run["flex_attention"] = run_flex
        for way in ways:
            try:
                seconds = timed(run[way], device, args.repeats) / args.layers
            except Exception as exc:  # noqa: BLE001 - a way that does not run here is a row that says why
                print(f"| {length} | {way} | failed: {type(exc).__name__}: {str(exc).splitlines()[0][:80]} | | | |")
                continue
            diff = (outs[way].float() - refs.get(way, ref)).abs().max().item()
            floor = floors.get(way, floor_s)
            row = {"length": length, "way": way, "ms_per_layer": 1e3 * seconds,
                   "kv_gbps": floor * rate / seconds / 1e9,
                   "x_floor": seconds / floor, "max_abs_diff": diff, **extra}
            rows_out.append(row)
            print(f"| {length} | {way} | {row['ms_per_layer']:.4f} | {row['kv_gbps']:.0f} | {row['x_floor']:.2f} | "
                  f"{diff:.2e} |")
        if "flex_mask_ms" in extra:
            print(f"(flex: building the block mask for one length took {extra['flex_mask_ms']:.2f} ms)")
    return rows_out


def sparse_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """fp32 attention of each query head over its selected rows of [H, cap, D] keys/values."""
    heads = torch.arange(keys.shape[0], device=keys.device)[:, None, None]
    k_sel, v_sel = keys[heads, slots].float(), values[heads, slots].float()  # [H, G, K, D]
    probs = torch.softmax(torch.einsum("hgd,hgkd->hgk", q.float(), k_sel) * scale, -1)
    return torch.einsum("hgk,hgkd->hgd", probs, v_sel)


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
