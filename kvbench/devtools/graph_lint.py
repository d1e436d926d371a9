"""A lint of the compiled decode step's graph: what one backend's code generation accepts and another's refuses.

The CPU tests compile the decode step with dynamo's eager backend, or with inductor's C++ code generation; a GPU
compiles it with inductor's Triton code generation, which refuses some graphs the CPU accepts. A step that only
the CPU accepts falls back to eager on every GPU (`engine.compile`), and no CPU test notices. This lint looks at
the graph a GPU would compile, on the CPU: `lint_backend()` is a dynamo backend that takes the ATen graph after
inductor's own decompositions (`aot_autograd`, as inductor does), raises `GraphLintError` naming every pattern
below it finds, and otherwise runs the graph eagerly (as `aot_eager`). `scripts/check_static_decode.py --lint`
runs it over every static method's decode step.

The patterns, each one that Triton refuses and the CPU's C++ accepts:

- **An integer constant outside int32 in arithmetic on an index** (`CONSTANT_ON_INDEX`). Inductor keeps what is
  computed from `arange` (`prims.iota` after decomposition) by integer pointwise ops and views as an index
  expression, which the kernel computes in its index type: int32 when the tensors have fewer than 2^31
  elements. A constant in that expression must then be an int32: Triton (3.3 on) refuses to narrow one that is
  not (`ValueError: Scalar 4294967295 is out of range for type int32`). Seen: `(1 << 32) - 1 - arange(L)` in
  `descending_keys` (now `(1 << 31) - 1`; inductor printed `4294967295 + ((-1)*x0)`), and `where(mask, |i - 32|,
  int64 max)` in another project. An `arange` whose start, end or step is outside int32 is the same case.

  The same constant on values that are not indices is accepted: an int64 tensor's values stay int64, and
  Triton widens the constant to them (DuoAttention's `where(retrieves, int64 max, sink + recent)` compiles on
  CUDA). So only constants on index-derived values are flagged.

- **A scan over more than 32 elements** (`SPLIT_SCAN`): `cumsum`, `cumprod`, `cummax`, `cummin`,
  `logcumsumexp`. Inductor splits such a scan across thread blocks on CUDA when few rows run it (`SplitScan`:
  one pass per block and a decoupled look-back), which its C++ code never does; on an H100 with torch 2.11 the
  Triton code for Quest's `held.cumsum(-1)` over 8 heads x 640 pages failed to generate (`InductorError:
  TypeError: list indices must be integers or slices, not NoneType`), so Quest, and every method choosing pages
  with it, decoded eagerly. 32 is inductor's bound: it splits no reduction or scan of 32 elements or fewer. The
  step keeps no scan now (`pages.held_first` is a stable top-k); a scan over the capacity is flagged whatever
  its dtype, since whether a split scan generates is the torch version's to decide and CI cannot ask a GPU.

`cuda_codegen_backend()` asks Triton itself instead of guessing: inductor's Triton code for the graph, generated
under a GPU's lowering rules (`gpu_lowering_rules`) and compiled by Triton's CUDA compiler for an H100 on the CPU
(`kvbench.devtools.cuda_target`). On the six graphs of
`scripts/probe_triton_lint.py` its verdicts are the H100's (`tests/test_cuda_codegen.py`), where the lint flags
one graph Triton accepts. It takes minutes where the lint takes seconds, and cannot see a split scan (inductor
splits by a GPU's processor count, and generated Quest's old scan unsplit for the CPU device), so both stay.

Considered and left out, as Triton accepts them or inductor does not hand them to Triton: complex tensors
(inductor generates no code for them on any device: it calls ATen's kernels, and warns), uint32/uint64 tensors
and float64 (Triton has those types; inductor's own kernels use uint32 and uint64 bit patterns).
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from kvbench.core.errors import KVBenchError

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1

aten, prims = torch.ops.aten, torch.ops.prims

# what inductor lowers to an index expression (`iota`): after its decompositions every arange is a prims.iota
# (the aten overloads are listed for a graph decomposed otherwise)
INDEX_SOURCES = {prims.iota.default, aten.arange.default, aten.arange.start, aten.arange.start_step}
# nodes that are one constant, inlined by inductor into the expressions that read them (the value's argument)
FILL_OPS = {aten.scalar_tensor.default: 0, aten.full.default: 1, aten.full_like.default: 1, aten.new_full.default: 2,
            aten.fill.Scalar: 1}

CONSTANT_ON_INDEX = "integer constant outside int32 on an index"
SPLIT_SCAN = "elements scanned, which inductor splits across blocks on CUDA"
SCAN_OPS = {aten.cumsum.default, aten.cumprod.default, aten.cummax.default, aten.cummin.default,
            aten.logcumsumexp.default}
UNSPLIT_SCAN = 32  # inductor splits no reduction or scan of this many elements or fewer (min_elements_per_thread)


class GraphLintError(KVBenchError):
    """A graph holds what Triton's code generation refuses (`lint_graph`'s findings, one line)."""


@dataclass(frozen=True)
class Finding:
    pattern: str
    value: int
    op: str
    where: str  # the source line the node was traced from, if the graph kept it

    def __str__(self) -> str:
        return f"{self.value} ({self.pattern}) in {self.op}" + (f" at {self.where}" if self.where else "")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _outside_int32(value: Any) -> bool:
    return _is_int(value) and not INT32_MIN <= value <= INT32_MAX


def _integer_valued(node: torch.fx.Node) -> bool:
    val = node.meta.get("val")
    return (isinstance(val, torch.Tensor) and val.dtype != torch.bool and not val.dtype.is_floating_point
            and not val.dtype.is_complex)


def _pointwise_or_view(target: Any) -> bool:
    """Ops inductor folds into the index expression of what they read: pointwise ops (casts included) and views."""
    if not isinstance(target, torch._ops.OpOverload):
        return False
    return torch.Tag.pointwise in target.tags or target.is_view


def _constant_of(node: Any, graph_module: torch.fx.GraphModule) -> Any:
    """The integer constant `node` is, as inductor inlines it: a Python number, a fill op's value, or a 0-d tensor
    constant of the graph (inductor turns every 0-d constant into a scalar). None when it is none of these."""
    if not isinstance(node, torch.fx.Node):
        return node if _is_int(node) else None
    if node.op == "call_function" and node.target in FILL_OPS:
        index = FILL_OPS[node.target]
        value = node.args[index] if len(node.args) > index else node.kwargs.get("fill_value")
        return value if _is_int(value) else None
    if node.op == "get_attr":
        value = operator.attrgetter(node.target)(graph_module)
        if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.dtype.is_floating_point:
            return int(value.item())
    return None


def _source_line(node: torch.fx.Node) -> str:
    """`file:line` and the code of the innermost frame the node was traced from, when the graph kept its stack."""
    trace = (node.meta.get("stack_trace") or "").strip().splitlines()
    for i in range(len(trace) - 1, -1, -1):
        line = trace[i].strip()
        if line.startswith('File "'):
            path, _, rest = line[len('File "'):].partition('", line ')
            lineno = rest.split(",")[0]
            short = path.split("/kvbench/")[-1] if "/kvbench/" in path else path.rsplit("/", 1)[-1]
            code = trace[i + 1].strip() if i + 1 < len(trace) else ""
            return f"{short}:{lineno} `{code}`" if code else f"{short}:{lineno}"
    return ""


def _inputs(node: torch.fx.Node) -> Iterator[Any]:
    """The node's top-level arguments (lists, as of sizes, are not values: left out)."""
    yield from node.args
    yield from node.kwargs.values()


def _scan_length(node: torch.fx.Node) -> int | None:
    """How many elements a scan node runs over (its input's size along its dim), when the graph knows it."""
    source = node.args[0] if node.args else None
    val = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if not isinstance(val, torch.Tensor) or not _is_int(dim) or val.dim() == 0:
        return None
    size = val.shape[dim]
    return int(size) if isinstance(size, int) else None


def lint_graph(graph_module: torch.fx.GraphModule) -> list[Finding]:
    """The patterns of the module's docstring found in an ATen graph (after inductor's decompositions)."""
    findings: list[Finding] = []
    index_like: set[torch.fx.Node] = set()
    for node in graph_module.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in SCAN_OPS:
            length = _scan_length(node)
            if length is not None and length > UNSPLIT_SCAN:
                findings.append(Finding(SPLIT_SCAN, length, str(node.target), _source_line(node)))
            continue
        if node.target in INDEX_SOURCES:
            index_like.add(node)
            constants = [value for value in _inputs(node) if _outside_int32(value)]
        elif (_pointwise_or_view(node.target) and _integer_valued(node)
              and any(isinstance(arg, torch.fx.Node) and arg in index_like for arg in _inputs(node))):
            index_like.add(node)
            constants = [value for arg in _inputs(node)
                         if _outside_int32(value := _constant_of(arg, graph_module))]
        else:
            continue
        findings += [Finding(CONSTANT_ON_INDEX, value, str(node.target), _source_line(node)) for value in constants]
    return findings


def lint_backend() -> Callable[..., Any]:
    """A dynamo backend: the graph after inductor's decompositions (`aot_autograd`, inference graphs keeping their
    input mutations, as inductor takes them) is linted, `GraphLintError` raised on any finding, and otherwise run
    eagerly (boxed, as aot_autograd calls it)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop
    from torch._inductor.decomposition import select_decomp_table

    def lint_then_run(graph_module: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        findings = lint_graph(graph_module)
        if findings:
            raise GraphLintError(f"{len(findings)} construct(s) Triton's code generation refuses: "
                                 + "; ".join(str(finding) for finding in findings))
        return boxed_nop(graph_module, example_inputs)

    return aot_autograd(fw_compiler=lint_then_run, decompositions=select_decomp_table(),
                        keep_inference_input_mutations=True)


def inductor_triton_sources(graph_module: torch.fx.GraphModule, example_inputs: list[Any],
                            arch: int = 90) -> list[tuple[str, str]]:
    """(name, source) of each Triton kernel inductor generates for a dynamo graph, as a GPU compile would generate
    them: inductor's Triton code generation pointed at the graph's CPU tensors (`cpu_backend="triton"`, the same
    code generator a CUDA device gets), under the lowering and fusion rules a GPU gets (`gpu_lowering_rules`),
    with a CPU's launch heuristics; Triton's compiler not called. Inductor's caches are off: a cached graph would
    generate nothing."""
    from unittest import mock

    from torch._inductor import config as inductor_config
    from torch._inductor.async_compile import AsyncCompile
    from torch._inductor.compile_fx import compile_fx

    from kvbench.devtools.cuda_target import cuda_target

    sources: list[tuple[str, str]] = []

    def keep_source(self: Any, kernel_name: str, source_code: str, device_str: str = "cuda") -> None:
        sources.append((kernel_name, source_code))

    settings = dict(cpu_backend="triton", fx_graph_cache=False, fx_graph_remote_cache=False, compile_threads=1)
    with inductor_config.patch(settings), mock.patch.object(AsyncCompile, "triton", keep_source), cuda_target(arch), \
            gpu_lowering_rules():
        compile_fx(graph_module, example_inputs)
    return sources


@contextlib.contextmanager
def gpu_lowering_rules() -> Iterator[None]:
    """Inductor's lowering and fusion rules for a GPU while it lowers CPU tensors, where it asks whether the device
    is a CPU rather than what the GPU has:

    - a `cat` whose inputs are pointwise becomes one pointwise kernel, which its consumer fuses; the CPU rule
      copies each input by its own kernel instead (`ConcatKernel`): the rotary embedding's `rotate_half`
      (`cat(-x2, x1)`) then cost four kernels a layer that the H200's profile shows fused into the rotary
      kernels (docs/gpu sections 7 and 8c);
    - a pointwise result read several times is recomputed by each reader unless it holds more than 30 operations
      or 8 accumulated reads (a CPU's thresholds: 50 and 12), whatever transcendental it computes (the CPU
      stores any result that computes `exp`, `log`, `tanh`... once);
    - the scheduler may reorder a node's loops to fuse it with another (the CPU's C++ code never does).

    What stays a CPU's: the choices inductor makes by a GPU's properties (a split reduction or scan, block sizes)
    and pad-as-cat (a `constant_pad_nd` as a `cat`, which no decode step has). On a torch whose `cat` lowering
    has no CPU rule written as this one's, its `cat` keeps the CPU rule: the counts then include the copies."""
    import inspect
    import textwrap
    from unittest import mock

    from torch._inductor import config as inductor_config
    from torch._inductor import ir, lowering, scheduler

    cpu_rule = "    if cpu_device:\n        return TensorBox(ir.ConcatKernel.create(inputs, dim))\n"
    source = textwrap.dedent(inspect.getsource(lowering.cat))
    gpu_cat: dict[Any, Any] = {}
    if cpu_rule in source and source.startswith("@register_lowering(aten.cat)\n"):
        registered: dict[Any, Any] = {}  # the copy's decorator registers it here, not in inductor's table
        namespace = dict(vars(lowering), registered=registered)  # the lowering module's globals
        source = source.replace("@register_lowering(aten.cat)", "@register_lowering(aten.cat, lowering_dict=registered)")
        exec(compile(source.replace(cpu_rule, ""), lowering.__file__, "exec"), namespace)  # noqa: S102
        cpu_cat = lowering.lowerings[torch.ops.aten.cat.default]
        gpu_cat = {op: registered[torch.ops.aten.cat] for op, rule in lowering.lowerings.items() if rule is cpu_cat}
    thresholds = dict(realize_opcount_threshold=inductor_config._realize_opcount_threshold_default,
                      realize_acc_reads_threshold=inductor_config._realize_acc_reads_threshold_default)
    with inductor_config.patch(thresholds), mock.patch.dict(lowering.lowerings, gpu_cat), \
            mock.patch.object(ir, "is_cpu", lambda node: False), \
            mock.patch.object(scheduler.BaseSchedulerNode, "is_cpu", lambda self: False):
        yield


def cuda_codegen_backend(arch: int = 90, kernels_per_graph: list[int] | None = None) -> Callable[..., Any]:
    """A dynamo backend: inductor's Triton code for the graph (`inductor_triton_sources`) compiled by Triton's CUDA
    compiler for sm_`arch` (`kvbench.devtools.cuda_target`: no GPU needed), every kernel with every configuration
    inductor would try; `TritonRefusal` on the first one refused, and otherwise the graph run eagerly. What it
    checks is what the lint's patterns guess at: Triton's own verdict on the code a GPU's compile generates. It
    does not see what inductor decides by a GPU's properties (a split scan: the lint's `SPLIT_SCAN`; block
    sizes), and compiles inductor's code only: the `kvbench.kernels` operators inside a graph are
    `scripts/check_cuda_codegen.py`'s. `kernels_per_graph`, if given, gains each graph's count of kernels."""
    from kvbench.devtools.cuda_target import compile_inductor_kernel

    def compile_then_run(graph_module: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        sources = inductor_triton_sources(graph_module, example_inputs, arch)
        if kernels_per_graph is not None:
            kernels_per_graph.append(len(sources))
        for name, source in sources:
            compile_inductor_kernel(name, source, arch)
        return graph_module.forward

    return compile_then_run
