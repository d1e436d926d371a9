"""KV-cache compression methods: every module in this package registers its methods in `METHODS`."""

import importlib
import pkgutil

from kvbench.core.errors import KVBenchError
from kvbench.methods.base import METHODS, Method, register_method

__all__ = ["METHODS", "Method", "register_method", "build_method"]

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")


def build_method(name: str, **params) -> Method:
    if name not in METHODS:
        raise KVBenchError(f"unknown method {name!r}; available: {', '.join(sorted(METHODS))}")
    try:
        return METHODS[name](**params)
    except (TypeError, ValueError) as exc:  # an unknown parameter, or one out of its range
        raise KVBenchError(f"method {name}: {exc}") from None
