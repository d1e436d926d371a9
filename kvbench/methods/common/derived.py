"""The cache's derived-state protocol (`kvbench.cache.layer`: `kept`, `append`, `truncate`, `nbytes`, `on_host`,
`paper_elements`) for the state that cache events leave as it is: host rows, an index built once, a factor."""

from __future__ import annotations

import dataclasses

import torch


class FixedState:
    """Derived state (a dataclass) that eviction, appends and rollbacks leave as it is: `kept`, `append` and
    `truncate` return it unchanged (new tokens stay resident; a class whose rows a rollback can reach writes its
    own `truncate`). `nbytes` counts its tensor fields (None skipped); it lives on the device (`on_host`) and is
    no auxiliary storage (`paper_elements`) unless the class says otherwise."""

    on_host = False
    paper_elements = 0

    def kept(self, layer) -> "FixedState":
        return self

    def append(self, layer, n: int) -> "FixedState":
        return self

    def truncate(self, layer) -> "FixedState | None":
        return self

    def nbytes(self) -> int:
        tensors = (getattr(self, f.name) for f in dataclasses.fields(self))
        return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
