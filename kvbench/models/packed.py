"""Linear layers whose weights are packed for fast products: on CPUs that multiply bfloat16 natively (AMX,
AVX512-BF16), `pack_linear_weights` (blocked weights, the projections of one input stacked); on CUDA in 16-bit
floats, `pack_projections` (the projections of one input stacked, dense)."""

from __future__ import annotations

import functools
import itertools
from typing import Any

import torch

PACKED_PROJECTIONS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # members that read one input


def pack_linear_weights(model: torch.nn.Module) -> None:
    """Store every linear layer's weight in oneDNN's blocked layout, once (CPU, bfloat16), and pack the
    projections that read the same input into one weight.

    A decode step is a matrix-vector product per weight; stock `F.linear` re-blocks the bfloat16 weight on
    every call, which took 22 ms of a 40 ms step of the embedded model on two cores, 16 ms when pre-blocked
    (`scripts/bench_decode_latency.py`). The query, key and value projections of an attention block, and the
    gate and up projections of an MLP, are then stacked into one blocked weight (`PackedProduct`): one
    product per input instead of three or two, which streams the weights faster (fewer, larger products).
    Each output column is the same oneDNN dot product over the same blocks whichever weight holds its row, so
    the outputs are bitwise those of stock `F.linear` (tested on both tiny models). A tied output head gets its
    own blocked copy (the embedding lookup keeps the plain one), which the weights' byte count includes.
    """
    _stack_projections(model, blocked=True, dtypes=(torch.bfloat16,))
    for module in model.modules():
        if _packable(module, (torch.bfloat16,)) and "forward" not in module.__dict__:
            blocked = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), 1)
            module.weight = torch.nn.Parameter(blocked, requires_grad=False)
            module.forward = _blocked_linear_forward.__get__(module)


def pack_projections(model: torch.nn.Module) -> None:
    """Stack the projections that read the same input (q/k/v, gate/up) into one dense weight each (CUDA, bfloat16
    or float16; `PackedProduct` with `blocked=False`).

    A decode step's products are matrix-vector products, one cuBLAS launch each and, for the smaller ones, a
    split of the sum and its reduction: on an H200 at Llama-3.1-8B's widths, 7 products and 5 reductions a
    layer; the key and value projections (8 MB of weights each) took 5.3 us where their bytes take 2.2
    (docs/journal/gpu.md section 7). Stacked, a layer's attention block reads its three weights in one product and the MLP
    its two: 4 products a layer. The products' outputs are the same sums over the same weights; cuBLAS chooses
    its kernel, and how it splits a sum, by the product's shape, so a stacked output may differ from the
    separate one in its last bits: float32 models are never stacked (full-cache float32 runs stay bitwise
    stock transformers), and the compiled step, whose sums inductor orders anyway, is where the gain is."""
    _stack_projections(model, blocked=False, dtypes=(torch.bfloat16, torch.float16))


def _stack_projections(model: torch.nn.Module, blocked: bool, dtypes: tuple[torch.dtype, ...]) -> None:
    for module in list(model.modules()):
        for names in PACKED_PROJECTIONS:
            members = [getattr(module, name, None) for name in names]
            if all(_packable(m, dtypes) for m in members) and len({m.in_features for m in members}) == 1 \
                    and len({m.bias is None for m in members}) == 1 and len({m.weight.device for m in members}) == 1:
                PackedProduct.install(module, names, blocked)


def _packable(module: Any, dtypes: tuple[torch.dtype, ...]) -> bool:
    return isinstance(module, torch.nn.Linear) and module.weight is not None and module.weight.dtype in dtypes


def _blocked_linear_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return blocked_linear(x, self.weight, self.bias)


def blocked_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`x @ weight.T + bias` with a weight in oneDNN's blocked layout. Inside `torch.compile` (the compiled decode
    step) through `kvbench::blocked_linear`, an opaque op that calls the same oneDNN product: inductor cannot lower
    `mkldnn._linear_pointwise` on a weight blocked outside its own freezing pass, and its own bf16 products read
    the weights slower than these (docs/journal/cpu_decode.md)."""
    if torch.compiler.is_compiling():
        return _blocked_linear_op(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@torch.library.custom_op("kvbench::blocked_linear", mutates_args=())
def _blocked_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@_blocked_linear_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


class PackedProduct(torch.nn.Module):
    """One weight stacking the rows of projections that read the same input (q/k/v, gate/up): in oneDNN's blocked
    layout (`blocked`, CPU) or dense.

    The first member called with an input computes the whole product; each member returns its column slice
    of it. The product is dropped once every member has taken its slice, so no activation outlives the layer
    (a member called again, or with another input, recomputes). Installed on the parent module as `packed_<first
    member>`; the members keep their shapes and a `weight` of None (the packed weight holds their rows)."""

    def __init__(self, members: list[torch.nn.Linear], blocked: bool = True):
        super().__init__()
        dense = torch.cat([m.weight.detach() for m in members])
        self.blocked = blocked
        self.weight = torch.nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(dense, 1) if blocked else dense,
                                         requires_grad=False)
        biases = [m.bias for m in members]
        self.bias = None if biases[0] is None else torch.nn.Parameter(torch.cat([b.detach() for b in biases]),
                                                                      requires_grad=False)
        self.in_features, self.out_features = members[0].in_features, dense.shape[0]
        ends = list(itertools.accumulate(m.out_features for m in members))
        self.bounds = list(zip([0, *ends[:-1]], ends))
        self._input: torch.Tensor | None = None
        self._output: torch.Tensor | None = None
        self._pending: set[int] = set()

    @classmethod
    def install(cls, parent: torch.nn.Module, names: tuple[str, ...], blocked: bool = True) -> None:
        members = [getattr(parent, name) for name in names]
        packed = cls(members, blocked)
        parent.add_module(f"packed_{names[0]}", packed)
        for index, member in enumerate(members):
            member.weight, member.bias = None, None
            member.forward = functools.partial(packed.member_output, index=index)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.blocked:
            return blocked_linear(x, self.weight, self.bias)
        return torch.nn.functional.linear(x, self.weight, self.bias)

    def member_output(self, x: torch.Tensor, index: int) -> torch.Tensor:
        if x is not self._input or index not in self._pending:
            self._input, self._output, self._pending = x, self(x), set(range(len(self.bounds)))
        lo, hi = self.bounds[index]
        out = self._output[..., lo:hi]
        self._pending.discard(index)
        if not self._pending:
            self._input = self._output = None
        return out


def weight_products(model: torch.nn.Module) -> list[tuple[torch.nn.Module, int]]:
    """Every weight product a forward runs, as (module computing it, bytes of its weight): the linear layers
    and the packed projections (`pack_linear_weights`), each weight once."""
    products = []
    for module in model.modules():
        if isinstance(module, (torch.nn.Linear, PackedProduct)) and module.weight is not None:
            weight = module.weight
            products.append((module, weight.numel() * weight.element_size()))
    return products
