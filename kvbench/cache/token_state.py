"""`TokenState`: a layer's method-owned per-token tensors (H2O's accumulated attention, ...) as a mapping."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import torch

FIXED_FIELDS = ("keys", "values", "positions")  # the layer's own fields: never method state


class TokenState(MutableMapping):
    """A layer's method-owned per-token tensors by name: `[H, L]` on a uniform layer, flat `[sum_h len_h]`
    (head after head) on a ragged one. Setting one installs a new buffer in the layer's row layout (clones
    keep the old one); reading a ragged one gathers its rows."""

    def __init__(self, layer: Any):  # the KVLayer (which imports this module)
        self.layer = layer

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in FIXED_FIELDS or name not in self.layer.buffers:
            raise KeyError(name)
        return self.layer.field(name)

    def __setitem__(self, name: str, value: torch.Tensor) -> None:
        if name in FIXED_FIELDS:
            raise KeyError(f"{name} is not method state")
        self.layer.set_field(name, value)

    def __delitem__(self, name: str) -> None:
        if name in FIXED_FIELDS or name not in self.layer.buffers:
            raise KeyError(name)
        del self.layer.buffers[name]

    def __iter__(self):
        return (name for name in list(self.layer.buffers) if name not in FIXED_FIELDS)

    def __len__(self) -> int:
        return sum(1 for _ in self)
