"""H2O as its release computes it: FMInference/H2O, commit ac75c2a8a9e76832b2a4139b9363373b56336bfb,
`h2o_hf/utils_real_drop/modify_llama.py` (`H2OKVCache_LayerWise`, `H2OLlamaAttention_drop.forward`).

The attention module repeats K/V to every query head, takes the softmax in float32 and hands the whole
`[1, H_q, q, L]` weight tensor to the cache, which adds its column sums over the chunk's queries
(`attn_score_cache.sum(0).sum(1)`) to the running `hh_score` (new columns start at the chunk's own sums).
Whenever more than `hh_size + recent_size` tokens are stored, each head keeps `topk(hh_score[:L - recent],
hh_size)` (sorted) plus the last `recent_size` tokens, and the kept scores travel with them. The release's
cache holds one row per *query* head and the mask it builds from `hh_score` (`[H_q, L]`) indexes the K/V
cache (`[H_kv, L, D]`): it runs on MHA models only (Llama-1/2, OPT, GPT-NeoX). `group_mean=True` is the GQA
form kvbench uses (the group's query heads averaged per KV head, KeyDiff App. F.2); `group_mean=False` is the
release on a GQA model's query heads, each selecting for itself.
"""

from __future__ import annotations

import math

import torch


class H2OLayer:
    """One layer's heavy-hitter cache. Keys/values `[H, L, D]` with H the query heads (MHA) or the KV heads
    (`group_mean`)."""

    def __init__(self, hh_size: int, recent_size: int, groups: int, group_mean: bool):
        self.hh_size, self.recent_size = hh_size, recent_size
        self.cache_size = hh_size + recent_size
        self.groups, self.group_mean = groups, group_mean
        self.hh_score: torch.Tensor | None = None
        self.keys = self.values = self.positions = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
        """A chunk of queries `[H_q, n, D]` with its keys/values `[H_kv, n, D]` at positions start..start+n-1.
        Returns the attention output `[H_q, n, D]`, then updates the scores and evicts."""
        n, dim = q.shape[1], q.shape[-1]
        positions = torch.arange(start, start + n)
        stored_groups = 1 if self.group_mean else self.groups
        k_new = k.repeat_interleave(stored_groups, dim=0) if stored_groups > 1 else k
        v_new = v.repeat_interleave(stored_groups, dim=0) if stored_groups > 1 else v
        if self.keys is None:
            self.keys, self.values = k_new, v_new
            self.positions = positions.expand(k_new.shape[0], n)
        else:
            self.keys = torch.cat([self.keys, k_new], dim=1)
            self.values = torch.cat([self.values, v_new], dim=1)
            self.positions = torch.cat([self.positions, positions.expand(k_new.shape[0], n)], dim=1)
        per_query = self.groups if self.group_mean else 1  # query heads per stored head
        keys = self.keys.repeat_interleave(per_query, dim=0)
        values = self.values.repeat_interleave(per_query, dim=0)
        logits = torch.matmul(q, keys.transpose(1, 2)) / math.sqrt(dim)
        future = self.positions.repeat_interleave(per_query, dim=0)[:, None, :] > positions[None, :, None]
        logits = logits + torch.where(future, torch.finfo(logits.dtype).min, 0.0)
        weights = torch.softmax(logits, dim=-1, dtype=torch.float32)
        out = torch.matmul(weights, values)
        if self.group_mean:
            weights = weights.view(-1, per_query, n, weights.shape[-1]).mean(dim=1)
        self._update_hh_score(weights)
        self._evict()
        return out

    def _update_hh_score(self, weights: torch.Tensor) -> None:
        n = weights.shape[1]
        sums = weights.sum(dim=1)  # the release's `.sum(0).sum(1)`, batch 1
        if self.hh_score is not None:
            sums[:, :-n] += self.hh_score
        self.hh_score = sums

    def _evict(self) -> None:
        length = self.keys.shape[1]
        if length <= self.cache_size:
            return
        _, top = torch.topk(self.hh_score[:, : length - self.recent_size], self.hh_size, dim=-1)
        keep = torch.cat([top.sort().values,
                          torch.arange(length - self.recent_size, length).repeat(top.shape[0], 1)], dim=-1)
        mask = torch.zeros(self.hh_score.shape, dtype=torch.bool).scatter(-1, keep, True)
        heads = self.keys.shape[0]
        self.keys = self.keys[mask].view(heads, -1, self.keys.shape[-1])
        self.values = self.values[mask].view(heads, -1, self.values.shape[-1])
        self.positions = self.positions[mask].view(heads, -1)
        self.hh_score = self.hh_score[mask].view(heads, self.cache_size)

    def kept(self) -> list[list[int]]:
        return [sorted(p.tolist()) for p in self.positions]
