"""KV-cache compression methods. Importing this package registers every method in `METHODS`."""

from kvbench.methods import adakv, exact_topk, full, snapkv, streamingllm  # noqa: F401  (registration)
from kvbench.methods.base import METHODS, Method, register_method

__all__ = ["METHODS", "Method", "register_method", "build_method"]


def build_method(name: str, **params) -> Method:
    from kvbench.errors import KVBenchError

    if name not in METHODS:
        raise KVBenchError(f"unknown method {name!r}; available: {', '.join(sorted(METHODS))}")
    try:
        return METHODS[name](**params)
    except TypeError as exc:
        raise KVBenchError(f"method {name}: {exc}") from None
