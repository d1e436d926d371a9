"""Choosing between a Triton kernel and its PyTorch reference.

`KVBENCH_KERNELS` selects the implementation: unset or "auto" runs Triton on CUDA tensors when triton is
installed and the reference otherwise; "torch" always runs the reference (to compare or to rule a kernel
out). triton itself is imported only by `kvbench.kernels._triton_kernels`, on the first Triton launch.
"""

from __future__ import annotations

import importlib.util
import logging
import os

import torch

from kvbench.core.errors import one_line

# find_spec rather than an import: importing triton costs ~0.2 s and fixes, for the whole process, whether
# its standard library (tl.sum, tl.max...) is compiled or interpreted (TRITON_INTERPRET); a CPU-only run
# never needs it.
HAS_TRITON = importlib.util.find_spec("triton") is not None
ENV_VAR = "KVBENCH_KERNELS"
_CHOICES = ("auto", "torch")
log = logging.getLogger("kvbench")


def use_triton(*tensors: torch.Tensor) -> bool:
    """Whether a dispatcher should launch its Triton kernel for these inputs.

    True iff triton is installed, every tensor is on a CUDA device, `KVBENCH_KERNELS` is not "torch", and no
    `torch.compile` is tracing the call (the compiled decode step, `engine.compile`).
    Read at each call, so the override applies to a process that imported kvbench already. Raises
    ValueError on any other value of the variable, so that a typo does not silently pick an implementation.
    """
    if torch.compiler.is_compiling():  # a compiled decode step traces the references: inductor writes its own kernels
        return False
    return triton_launchable(*tensors)


def triton_launchable(*tensors: torch.Tensor) -> bool:
    """`use_triton` without its rule for `torch.compile`: for a kernel registered as an operator that a compiled
    step captures as it is (`kvbench.kernels.flash_decode`)."""
    choice = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if choice not in _CHOICES:
        raise ValueError(f"{ENV_VAR}={choice!r}: expected one of {', '.join(_CHOICES)}")
    return choice == "auto" and HAS_TRITON and all(t.is_cuda for t in tensors)


class LaunchFallback:
    """A Triton operator's guard: a launch that raises (a Triton or driver error on some GPU) logs one warning
    line, and the PyTorch reference runs instead, for that call and every later one in the process. The
    references give the same results (or the same up to the order of float sums), so a run goes on, slower."""

    def __init__(self, name: str, reference_name: str):
        self.name, self.reference_name = name, reference_name
        self.failed: list[str] = []  # the first launch error, once a launch has failed

    def run(self, launch, reference):
        """`launch()`, or `reference()` once a launch has failed."""
        if not self.failed:
            try:
                return launch()
            except Exception as exc:  # noqa: BLE001 - any launch error: the reference computes the same
                self.failed.append(one_line(exc))
                log.warning("%s: the Triton kernel failed (%s); %s runs instead", self.name, self.failed[0],
                            self.reference_name)
        return reference()

    def implementation(self, device: "torch.device | str") -> str:
        """Which implementation runs on `device`: the Triton operator (`kvbench::<name>`), or the reference (where
        the operator does not apply, or with the reason its launch failed)."""
        if self.failed:
            return f"{self.reference_name} (the Triton operator failed: {self.failed[0]})"
        return f"the Triton operator (kvbench::{self.name})" if triton_launchable(torch.empty(0, device=device)) \
            else self.reference_name
