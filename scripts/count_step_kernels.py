"""The kernels of each method's compiled decode step as a GPU's compile generates them, counted on a CPU.

    python scripts/count_step_kernels.py                      # one layer of Llama-3.1-8B's widths, bf16
    python scripts/count_step_kernels.py --methods quest,hsa --list
    python scripts/count_step_kernels.py --model tiny_llama --methods full,quest      # a smoke run

On a GPU the compiled step is one CUDA graph whose kernels run back to back, and a selection's small kernels
cost a few microseconds each whatever they compute (docs/gpu section 7: the selection methods' steps launched
258-379 kernels for 8 layers, SnapKV's 171). Here each static method's step is traced under the CUDA rule
(`kvbench::flash_decode`, `::stable_topk`, `::group_scores` and `::distinct_rows` in the graph, as on CUDA),
inductor generates the graph's Triton code under a GPU's lowering and fusion rules
(`graph_lint.inductor_triton_sources`, `gpu_lowering_rules`: a `cat` fused into its consumer, not copied input
by input as the CPU's rule does; nothing is compiled or run), and the step then decodes eagerly. Printed per
method: inductor's kernels and kvbench's operators, each also minus full's (what a layer's selection adds), and
the weight products (cuBLAS's on CUDA; with the projections of one input stacked, as `load_model` leaves a
16-bit model on CUDA: 4 a layer and the output head). Not counted: cuBLAS's split-sum reductions, ATen fallbacks
(a float `topk`), a second launch of an operator (the stable top-k's second level, split-K's merge); and the
launch heuristics are a CPU's (a reduction a GPU splits in two counts once). A count, not a time.
"""

from __future__ import annotations

import argparse
import logging
import os

import torch

from kvbench.bench.shapes import LAYER_MODEL, model_config
from kvbench.devtools import static_decode

SELECTION = "full,snapkv,quest,sparq,hsa,rocketkv,exact_topk"


class Counted(Exception):
    """Raised by the counting backend once it has the graph's kernels: the step then decodes eagerly."""


def force_cuda_rule() -> None:
    """Trace every kvbench operator into the graph as on CUDA; at run time a launch on the CPU falls back (the
    operators' `LaunchFallback`) or the step is eager, where the static layout's attention is not used."""
    import kvbench.cache.static as static_layout
    from kvbench.kernels import distinct_rows, group_scores, stable_topk

    static_layout.flash_decode_applies = lambda keys: True
    for module in (stable_topk, group_scores, distinct_rows):
        module.triton_launchable = lambda *tensors: True


def count(model: str, methods: list[str], listing: bool) -> dict[str, tuple[int, int, int]]:
    """{method: (inductor kernels, kvbench operators, weight products)} of one decode step, and the kernels' names
    with `listing`. The model's projections are stacked as `load_model` stacks them on CUDA (`pack_projections`,
    16-bit models), where this CPU did not pack them already (`pack_linear_weights`, blocked)."""
    from kvbench.devtools import graph_lint
    from kvbench.engine.compiled import CompiledDecoder
    from kvbench.models import PackedProduct, load_model, pack_projections

    lm = load_model(model_config(model))
    if not any(isinstance(module, PackedProduct) for module in lm.model.modules()):
        pack_projections(lm.model)  # a float32 model stays as it is, as on CUDA
    names: list[str] = []
    products: list[int] = []

    def backend(graph_module: torch.fx.GraphModule, example_inputs: list) -> None:
        names.extend(name for name, _ in graph_lint.inductor_triton_sources(graph_module, example_inputs))
        calls = [node for node in graph_module.graph.nodes if node.op == "call_function"]
        names.extend(f"op {node.target}" for node in calls if str(node.target).startswith("kvbench.")
                     and "blocked_linear" not in str(node.target))  # the CPU's linear, cuBLAS on CUDA
        products.append(sum(node.target is torch._C._nn.linear or "blocked_linear" in str(node.target)
                            for node in calls))
        raise Counted

    decoder = CompiledDecoder(lm, backend)
    counts = {}
    for label, name, settings, budget in static_decode.STATIC:
        if label not in methods:
            continue
        names.clear()
        products.clear()
        session = static_decode.Session(lm, static_decode.method_for(lm, name, settings), budget)
        logits, _ = session.prefill(static_decode.prompt(budget + 10 if budget > 640 else 200, seed=1),
                                    compress=True)
        session.decoder = decoder  # no recall measured: a timed run's step
        session.begin_decode(1)
        session.step(int(logits.argmax()))
        session.end_decode()
        ops = sum(n.startswith("op ") for n in names)
        counts[label] = (len(names) - ops, ops, sum(products))
        if listing:
            print(f"\n{label}:\n    " + "\n    ".join(names))
    return counts


def main(argv: list[str] | None = None) -> dict[str, tuple[int, int, int]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=LAYER_MODEL, help=f"{LAYER_MODEL} or a model config (tiny_llama)")
    parser.add_argument("--methods", default=SELECTION, help="labels of scripts/check_static_decode.py's table")
    parser.add_argument("--list", action="store_true", help="also each step's kernels and operators")
    args = parser.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)  # inductor's code generation only: nothing is interpreted
    logging.getLogger("kvbench").setLevel(logging.ERROR)  # each step's eager fallback, by design
    force_cuda_rule()
    methods = args.methods.split(",")
    counts = count(args.model, methods, args.list)
    base = counts.get("full")
    print(f"\n{args.model}: one decode step (every layer) under the CUDA rule, inductor's Triton code generated on "
          "the CPU")
    print(f"{'method':22} {'kernels':>7} {'operators':>9} {'weight products':>15}"
          + (f" {'kernels - full':>14} {'operators - full':>16}" if base else ""))
    for label in methods:
        if label in counts:
            kernels, ops, weight_products = counts[label]
            extra = f" {kernels - base[0]:14d} {ops - base[1]:16d}" if base else ""
            print(f"{label:22} {kernels:7d} {ops:9d} {weight_products:15d}{extra}")
    return counts


if __name__ == "__main__":
    main()
