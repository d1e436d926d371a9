"""KV rows a method moves off the accelerator (CTKVR's prompt middle, OmniKV's context bank), and the top-k
recall of a step that attends to rows on both sides.

A `HostSegment` lives in host memory (pinned when the model runs on CUDA, so copies back are asynchronous);
on a CPU-only machine host and device are the same memory and the move is one gather into new tensors, so
no second copy exists. It is derived state in the cache (`layer.derived`): it survives the eviction that moved
its rows out of the layer's storage (`kept`), drops rows on a rollback past them, and its bytes are reported
as host bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench.methods.common.derived import FixedState


@dataclass(frozen=True)
class HostSegment(FixedState):
    """Rows of one layer in host memory: keys/values [H, M, D] and their logical positions [H, M]."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    on_host = True
    paper_elements = 0  # K/V, not auxiliary storage (RocketKV Table 1's convention)

    @classmethod
    def of(cls, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor,
           before: "HostSegment | None" = None) -> "HostSegment":
        """`rows` of [H, n, ...] storage views moved to host memory, after the rows already there."""
        moved = [t.index_select(1, rows.to(t.device)).to("cpu") for t in (keys, values, positions)]
        if keys.device.type == "cuda":
            moved = [t.pin_memory() for t in moved]
        if before is not None:
            moved = [torch.cat([old, new], dim=1) for old, new in zip((before.keys, before.values, before.positions), moved)]
        return cls(*moved)

    # `FixedState`: the eviction that moved the rows here does not touch them; new tokens stay on the device
    def truncate(self, layer) -> "HostSegment":
        keep = self.positions[0] < layer.seen
        if bool(keep.all()):
            return self
        return HostSegment(self.keys[:, keep].clone(), self.values[:, keep].clone(), self.positions[:, keep].clone())

    @property
    def kv_tokens(self) -> int:  # all heads
        return self.positions.numel()


def recall_of(q: torch.Tensor, keys: torch.Tensor, chosen: torch.Tensor, valid: torch.Tensor | None,
              scaling: float) -> float:
    """Top-k attention recall of a step that attends to rows `chosen` [H, k] (`valid` [H, k] marks padding)
    of `keys` [H, N, D], every token the layer holds wherever it lives: the exact attention mass on the
    chosen rows over the mass of the exact top as many tokens, averaged over query heads."""
    group = q.shape[1]
    probs = torch.softmax(torch.einsum("hgd,hnd->hgn", q.float(), keys.float()) * scaling, dim=-1)
    mass = probs.gather(-1, chosen.clamp(min=0)[:, None, :].expand(-1, group, -1))
    if valid is not None:
        mass = mass * valid[:, None, :]
    count = chosen.shape[1] if valid is None else int(valid.sum(dim=1).min())
    return mass_recall(probs, mass.sum(-1), min(count, probs.shape[-1]))


def resident_and_host_recall(q: torch.Tensor, resident: torch.Tensor, host: torch.Tensor, rows: torch.Tensor,
                              valid: torch.Tensor, scaling: float) -> float:
    """`recall_of` a step that attends to every resident row (keys `resident` [H, n, D]) and the host rows `rows`
    [H, m] (`valid` [H, m] marks padding) of `host` [H, M, D], over every token on both sides."""
    heads, n_res = resident.shape[:2]
    everything = torch.cat([resident, host.to(q.device)], dim=1)
    every_resident = torch.arange(n_res, device=q.device).expand(heads, n_res)
    chosen = torch.cat([every_resident, n_res + rows.to(q.device)], dim=1)
    chosen_valid = torch.cat([torch.ones_like(every_resident, dtype=torch.bool), valid.to(q.device)], dim=1)
    return recall_of(q, everything, chosen, chosen_valid, scaling)


def mass_recall(probs: torch.Tensor, chosen_mass: torch.Tensor, k: int) -> float:
    """Top-k attention-mass recall: the attention mass a step attended (`chosen_mass` [H, G]) over the mass of
    the exact top-`k` tokens of `probs` [H, G, N], averaged over query heads (1 for Exact-TopK)."""
    return float(mass_recall_tensor(probs, chosen_mass, k))


def mass_recall_tensor(probs: torch.Tensor, chosen_mass: torch.Tensor, k: int) -> torch.Tensor:
    """`mass_recall` as a 0-d tensor where it was computed (a static decode step does not wait to read it)."""
    best = probs.topk(k, dim=-1).values.sum(-1)
    return (chosen_mass / best).mean()
