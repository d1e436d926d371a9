"""Triton's CUDA compiler on a machine without a GPU: a kernel compiled for an H100 (or an A100) on the CPU.

Triton compiles a kernel for a target it is given (`GPUTarget("cuda", 90, 32)`: source, Triton IR, LLVM IR,
PTX, then a cubin by the `ptxas` its wheel ships); only loading and launching the cubin need a driver. So what
Triton refuses on a GPU (an integer constant it cannot narrow, a layout it cannot lower, a block too large for
the shared memory) it refuses here too, where Triton's interpreter (`TRITON_INTERPRET=1`, the CPU tests' way to
run a kernel) accepts it. Two uses:

- `compile_launches(arch)`: inside it, a launch `kernel[grid](*args)` compiles the kernel for the target with
  exactly the launch's arguments (their dtypes, alignments and constexprs) and returns without running it.
  `scripts/check_cuda_codegen.py` calls each launcher of `kvbench.kernels` this way at the shapes a GPU run
  gives it.
- `compile_inductor_kernel(name, source, arch)`: one kernel of inductor's generated Triton code compiled with
  every launch configuration inductor would try (`kvbench.devtools.graph_lint.cuda_codegen_backend` generates
  them from a compiled decode step's graph).

Triton reads `TRITON_INTERPRET` when it is imported: under the interpreter `@triton.jit` makes no compilable
function, so these run in a process without it (the tests start one).
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch

from kvbench.core.errors import KVBenchError, one_line

ARCHS = {"h100": 90, "a100": 80}  # compute capability of each target a run names
# the most shared memory one program may use (bytes; the opt-in maximum per block): above it the launch fails
SHARED_MEMORY_LIMIT = {90: 232448, 80: 166912}
WARP_SIZE = 32


class TritonRefusal(KVBenchError):
    """Triton's CUDA compiler refused a kernel, or compiled one a launch on the GPU would refuse (one line)."""


@dataclass(frozen=True)
class CompiledLaunch:
    """What compiling one kernel for a target gave."""

    kernel: str
    arch: int
    constants: str  # the constexprs and options that distinguish this compile (BLOCK=64, num_warps=4, ...)
    shared_bytes: int
    registers: int | None  # per thread, from the cubin (ptxas's allocation): None when cuobjdump could not say
    local_bytes: int | None  # per thread: registers spilled to local memory (0 in a kernel that fits its registers)
    seconds: float


class _TargetDriver:
    """Triton's active driver, as much of it as compiling needs: the target, and a device key of its own (Triton
    keeps one cache of compiled kernels per device)."""

    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, WARP_SIZE)

    def get_current_target(self) -> Any:
        return self.target

    def get_current_device(self) -> str:
        return f"compile-only-sm{self.target.arch}"

    def get_current_stream(self, device: Any = None) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


def _require_compiler() -> None:
    from triton import knobs

    if knobs.runtime.interpret:
        raise KVBenchError("TRITON_INTERPRET=1: Triton's interpreter compiles nothing; run without it")


@contextlib.contextmanager
def cuda_target(arch: int = 90) -> Iterator[None]:
    """Triton's active driver is a CUDA target of compute capability `arch` (90: H100) while inside."""
    from triton.runtime import driver

    _require_compiler()
    saved = driver._active  # noqa: SLF001 - `reset_active` would create a real driver, which a CPU lacks
    driver.set_active(_TargetDriver(arch))
    try:
        yield
    finally:
        driver._active = saved  # noqa: SLF001


def _compiled(kernel: str, arch: int, binary: Any, constants: str, start: float) -> CompiledLaunch:
    """The `CompiledLaunch` of a compiled kernel; `TritonRefusal` when its launch would fail for shared memory
    (checked by Triton at load, on the GPU)."""
    shared = int(binary.metadata.shared)
    limit = SHARED_MEMORY_LIMIT.get(arch)
    if limit is not None and shared > limit:
        raise TritonRefusal(f"{kernel}: {shared} bytes of shared memory, over sm_{arch}'s {limit} per block")
    registers, local = _resource_usage(binary.asm["cubin"])
    return CompiledLaunch(kernel, arch, constants, shared, registers, local, time.perf_counter() - start)


def _resource_usage(cubin: bytes) -> tuple[int | None, int | None]:
    """(registers, local memory bytes) per thread of the cubin's kernel, as `cuobjdump --dump-resource-usage`
    (shipped with Triton) reads them; (None, None) if it cannot."""
    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        try:
            report = subprocess.run([knobs.nvidia.cuobjdump.path, "--dump-resource-usage", file.name],
                                    capture_output=True, text=True, timeout=60).stdout
        except (OSError, subprocess.SubprocessError, AttributeError):
            return None, None
    found = re.search(r"REG:(\d+) .*LOCAL:(\d+)", report)
    return (int(found[1]), int(found[2])) if found else (None, None)


@contextlib.contextmanager
def compile_launches(arch: int = 90) -> Iterator[list[CompiledLaunch]]:
    """Inside, `kernel[grid](*args, **constexprs)` compiles the kernel for sm_`arch` and launches nothing: the
    list yielded gains one `CompiledLaunch` per launch. Integer tensors passed to a launch are zeroed, so that
    what a launcher does next with the indices its kernel would have written (a gather) stays in range. A
    refusal raises `TritonRefusal` naming the kernel."""
    from triton.runtime.jit import JITFunction

    compiled: list[CompiledLaunch] = []

    def compile_instead(self: Any, grid: Any) -> Any:
        def launch(*args: Any, **kwargs: Any) -> Any:
            name = getattr(self, "__name__", str(self))
            start = time.perf_counter()
            try:
                binary = self.run(*args, grid=grid, warmup=True, **kwargs)
            except Exception as exc:  # noqa: BLE001 - Triton's refusal, named by kernel
                raise TritonRefusal(f"{name} for sm_{arch}: {one_line(exc)}") from exc
            constants = ", ".join(f"{k}={v}" for k, v in sorted(kwargs.items()))
            compiled.append(_compiled(name, arch, binary, constants, start))
            for arg in args:
                if isinstance(arg, torch.Tensor) and not (arg.is_floating_point() or arg.is_complex()):
                    arg.zero_()
            return binary

        return launch

    with cuda_target(arch), mock.patch.object(JITFunction, "__getitem__", compile_instead):
        yield compiled


def compile_inductor_kernel(name: str, source: str, arch: int = 90) -> list[CompiledLaunch]:
    """Compile kernel `name` of inductor's generated module `source` for sm_`arch` with each launch
    configuration inductor would try (its autotuner's configs; a launch compiles them all before it picks one,
    so any refused one fails the step). `TritonRefusal` names the kernel and what Triton refused."""
    import triton
    from torch._inductor.codecache import PyCodeCache
    from triton.compiler import ASTSource

    _require_compiler()
    autotuner = getattr(PyCodeCache.load(source), name)
    compiled = []
    with cuda_target(arch):
        target = triton.runtime.driver.active.get_current_target()
        for config in autotuner.configs:
            meta = autotuner._create_compile_meta(config)  # noqa: SLF001 - inductor's own step before triton.compile
            options = {"num_warps": meta["num_warps"], "num_stages": meta["num_stages"], "debug": meta["debug"],
                       "sanitize_overflow": False}
            if "enable_fp_fusion" in meta:
                options["enable_fp_fusion"] = meta["enable_fp_fusion"]
            start = time.perf_counter()
            try:
                binary = triton.compile(ASTSource(autotuner.fn, meta["signature"], meta["constants"],
                                                  meta["configs"][0]), target=target, options=options)
            except Exception as exc:  # noqa: BLE001 - Triton's refusal, named by kernel
                raise TritonRefusal(f"{name} for sm_{arch}: {one_line(exc)}") from exc
            constants = ", ".join(f"{k}={v}" for k, v in sorted(config.kwargs.items()))
            compiled.append(_compiled(name, arch, binary, f"{constants}, num_warps={config.num_warps}", start))
    return compiled
