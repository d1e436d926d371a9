"""InfLLM's block memory (kvbench/methods/infllm.py): the blocks moved to host memory, their representative keys
on the device, and the LRU device cache of blocks, each in the cache's derived-state protocol (`kept`, `append`,
`truncate`, `nbytes`, `paper_elements`; `FixedState`'s, new tokens staying resident)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvbench.methods.common.derived import FixedState


@dataclass(frozen=True)
class BlockMemory(FixedState):
    """One layer's block memory in host memory: keys and values `[B, H, bs, D]` (keys pre-RoPE with
    `memory_positions=infllm`, post-RoPE with `exact`), each block's first position `starts` `[B]` and valid rows
    `lengths` `[B]` (bs unless a rollback cut the block)."""

    keys: torch.Tensor
    values: torch.Tensor
    starts: torch.Tensor
    lengths: torch.Tensor
    on_host = True

    def added(self, keys: torch.Tensor, values: torch.Tensor, starts: torch.Tensor) -> "BlockMemory":
        """New blocks after these (a new object: a copy of the cache may share this one)."""
        lengths = torch.full_like(starts, keys.shape[2])
        return BlockMemory(*(torch.cat([old, new]) for old, new in zip(
            (self.keys, self.values, self.starts, self.lengths), (keys, values, starts, lengths))))

    @property
    def blocks(self) -> int:
        return self.keys.shape[0]

    def truncate(self, layer) -> "BlockMemory | None":
        alive = self.starts < layer.seen
        if bool(alive.all()) and int((self.starts + self.lengths).max()) <= layer.seen:
            return self
        if not bool(alive.any()):
            return None
        lengths = (layer.seen - self.starts[alive]).clamp(max=self.keys.shape[2])
        return BlockMemory(self.keys[alive], self.values[alive], self.starts[alive], torch.minimum(
            self.lengths[alive], lengths))

    @property
    def kv_tokens(self) -> int:
        return self.keys.shape[1] * int(self.lengths.sum())


@dataclass(frozen=True)
class BlockReprs(FixedState):
    """Each block's representative key per query head, `[B, H, G, D]` on the device, and its first position."""

    reprs: torch.Tensor
    starts: torch.Tensor

    def truncate(self, layer) -> "BlockReprs | None":
        alive = self.starts < layer.seen
        if bool(alive.all()):
            return self
        return BlockReprs(self.reprs[alive], self.starts[alive]) if bool(alive.any()) else None

    @property
    def paper_elements(self) -> int:  # representative keys: auxiliary storage
        return self.reprs.numel()


@dataclass
class BlockCache(FixedState):
    """InfLLM's LRU device cache of at most `capacity` blocks (`CudaCache` + `cached_blocks`): each cached
    block's last use, and its device copy when the memory lives in another device's memory. Updated in place at
    every step, so a copy of the cache forks it; blocks a rollback removed are forgotten at the next step
    (`prune`)."""

    capacity: int
    last_use: dict[int, int] = field(default_factory=dict)
    copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    clock: int = 0

    def load(self, chosen: list[int], memory: BlockMemory | None = None,
             device: torch.device | None = None) -> tuple[int, int]:
        """Make `chosen` resident (`remove_lru_blocks`, then the repo's `lru` stamp): (hits, misses)."""
        misses = [b for b in chosen if b not in self.last_use]
        excess = len(self.last_use) + len(misses) - self.capacity
        for b, _ in sorted(self.last_use.items(), key=lambda item: item[1]):  # oldest first, ties in load order
            if excess <= 0:
                break
            if b not in chosen:
                del self.last_use[b]
                self.copies.pop(b, None)
                excess -= 1
        self.clock += 1
        for b in chosen:
            self.last_use[b] = self.clock
        if memory is not None and memory.keys.device != device:
            for b in misses:
                self.copies[b] = (memory.keys[b].to(device), memory.values[b].to(device))
        return len(chosen) - len(misses), len(misses)

    def gather(self, chosen: list[int], memory: BlockMemory, device: torch.device) -> tuple[torch.Tensor, ...]:
        """Keys and values `[H, k * bs, D]` of the chosen blocks on `device`, and their valid rows (None: all)."""
        pairs = [self.copies.get(b, (memory.keys[b], memory.values[b])) for b in chosen]
        keys, values = (torch.stack([p[i] for p in pairs]).to(device).transpose(0, 1).flatten(1, 2) for i in (0, 1))
        lengths = memory.lengths[chosen]
        if bool((lengths == memory.keys.shape[2]).all()):
            return keys, values, None
        valid = torch.arange(memory.keys.shape[2]) < lengths[:, None]
        return keys, values, valid.flatten().to(device).expand(keys.shape[0], -1)

    def prune(self, blocks: int) -> None:
        """Forget blocks a rollback removed."""
        for b in [b for b in self.last_use if b >= blocks]:
            del self.last_use[b]
            self.copies.pop(b, None)

    def fork(self) -> "BlockCache":
        return BlockCache(self.capacity, dict(self.last_use), dict(self.copies), self.clock)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.copies.values() for t in pair)
