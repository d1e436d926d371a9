"""The one exception type the CLI turns into a single readable error line (no traceback wall)."""

from __future__ import annotations


class KVBenchError(RuntimeError):
    """A user-facing error: bad config, missing model or data, impossible request."""


def one_line(exc: BaseException) -> str:
    """One line for a record and a warning: the exception's type and its message's first line. An error another
    wraps (dynamo's `BackendCompilerFailed`, inductor's `InductorError`: their first line only names the backend)
    is described by the error inside, and a Triton `CompilationError` by its last line (the first is the kernel's
    line and column; the last says what Triton refused)."""
    inner = exc
    while isinstance(getattr(inner, "inner_exception", None), BaseException):
        inner = inner.inner_exception
    lines = str(inner).strip().splitlines() or [""]
    line = lines[-1] if type(inner).__name__ == "CompilationError" else lines[0]
    return f"{type(exc).__name__}: {line}" if inner is exc else f"{type(exc).__name__}: {type(inner).__name__}: {line}"
