"""`GrowingBuffers`: a method's derived tensors kept at a capacity and updated in place, shared by the cache's
clones until one of them writes (copy on write), as the cache's own row buffers are."""

from __future__ import annotations

import copy
import math

import torch

GROWTH = 0.25  # spare room beyond what is used: a quarter more (amortised O(1) appends), as the cache's rows
MIN_SPARE = 4


class GrowingBuffers:
    """Tensors that grow along `dim`, of which the first `used` entries hold data and the rest is spare.

    Re-concatenating a derived tensor on every decode step copies all of it (page summaries, SparQ's
    transposed keys: the keys' size again, every step). Here an update writes into the spare room instead:
    `reserve` sizes it for the tokens about to be decoded (the cache reserves them with its own rows), and
    an append that finds no room grows it by a quarter. Holders that share the tensors (`fork`: a prefill
    snapshot, a teacher-forcing twin) count themselves in one `sharers` cell; while it is above one,
    `writable` first moves the holder onto its own copies.
    """

    def __init__(self, tensors: list[torch.Tensor], used: int, dim: int):
        self.dim, self.used, self.tensors = dim, used, tensors
        self._sharers = [1]

    def reserve(self, more: int) -> None:
        """Room for `more` entries past those used, so that writing them copies nothing."""
        if self._sharers[0] == 1 and self.used + more > self.tensors[0].shape[self.dim]:
            self.tensors = [self._moved(t, self.used, self.used + more) for t in self.tensors]

    def view(self, index: int) -> torch.Tensor:
        """The used part of tensor `index`."""
        return self.tensors[index].narrow(self.dim, 0, self.used)

    def fork(self) -> "GrowingBuffers":
        twin = copy.copy(self)  # the same tensors and the same `sharers` cell
        twin.tensors = list(self.tensors)
        self._sharers[0] += 1
        return twin

    def writable(self, keep: int, needed: int) -> list[torch.Tensor]:
        """The tensors, ready for writes to entries `keep .. needed - 1`: entries before `keep` are kept, later
        ones are free to overwrite. Copies (the first `keep` entries) when shared or out of room."""
        if self._sharers[0] > 1 or needed > self.tensors[0].shape[self.dim]:
            capacity = max(with_spare(needed), self.tensors[0].shape[self.dim])
            self.tensors = [self._moved(t, keep, capacity) for t in self.tensors]
            self._sharers[0] -= 1
            self._sharers = [1]
        return self.tensors

    def _moved(self, tensor: torch.Tensor, keep: int, capacity: int) -> torch.Tensor:
        shape = list(tensor.shape)
        shape[self.dim] = capacity
        new = tensor.new_empty(shape)
        new.narrow(self.dim, 0, keep).copy_(tensor.narrow(self.dim, 0, keep))
        return new


def with_spare(used: int) -> int:
    return used + max(MIN_SPARE, math.ceil(GROWTH * used))
