"""KV-cache compression methods: every module in this package registers its methods in `METHODS`."""

import dataclasses
import importlib
import logging
import pkgutil
from typing import Any

from omegaconf import DictConfig, OmegaConf

from kvbench.core.errors import KVBenchError
from kvbench.methods.base import METHODS, Method, register_method

__all__ = ["METHODS", "Method", "register_method", "build_method", "method_parameters"]

log = logging.getLogger("kvbench")

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")


def build_method(name: str, **params) -> Method:
    if name not in METHODS:
        raise KVBenchError(f"unknown method {name!r}; available: {', '.join(sorted(METHODS))}")
    try:
        return METHODS[name](**params)
    except (TypeError, ValueError) as exc:  # an unknown parameter, or one out of its range
        raise KVBenchError(f"method {name}: {exc}") from None


def method_parameters(method_cfg: DictConfig) -> dict[str, Any]:
    """The parameters `build_method` takes from a `method:` config.

    A setting the method does not have is an error naming the settings it has, except for a method that
    compresses nothing (`full`): a setting shared across a sweep (`-m method=full,snapkv ++method.block_size=128`)
    cannot change its result, so it is left out, with a line saying so."""
    params = {k: v for k, v in OmegaConf.to_container(method_cfg, resolve=True).items() if k != "name"}
    cls = METHODS.get(method_cfg.name)
    if cls is None:
        return params  # build_method names the unknown method
    accepted = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(params) - accepted)
    if unknown and not cls.uses_budget:
        log.info("method %s compresses nothing: its points ignore %s", cls.name,
                 ", ".join(f"method.{k}" for k in unknown))
        return {k: v for k, v in params.items() if k in accepted}
    if unknown:
        raise KVBenchError(f"method.{unknown[0]} is not a setting of method {method_cfg.name} (its settings: "
                           f"{', '.join(sorted(accepted)) or 'none'}); set it only where it exists")
    return params
