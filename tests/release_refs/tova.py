"""TOVA as its release computes it: schwartz-lab-NLP/TOVA, commit 9c7d09bfff64cfc92cfb5f9d7e138cb04866e5a7,
`src/tova_cache.py` (`TOVACache.reduce`) and `src/convert_models/llama_custom.py` (the attention that calls it).

After every forward the attention weights `[1, H_q, q, L]` (K/V repeated to the query heads, softmax in
float32, then the model's dtype) go to `reduce`: if more than `cache_size` keys are stored, the last query's
row is averaged over *all* query heads of the layer (`torch.mean(attn_weights[:, :, -1, :], dim=1)`), the
top `cache_size` keys by that one score are kept (sorted), the same tokens in every KV head. The newest token
competes by its own weight like any other.
"""

from __future__ import annotations

import math

import torch


class TOVALayer:
    def __init__(self, cache_size: int, groups: int):
        self.cache_size, self.groups = cache_size, groups
        self.keys = self.values = self.positions = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
        """q `[H_q, n, D]`, k/v `[H_kv, n, D]` at positions start..start+n-1; returns the output `[H_q, n, D]`."""
        n, dim = q.shape[1], q.shape[-1]
        positions = torch.arange(start, start + n)
        if self.keys is None:
            self.keys, self.values, self.positions = k, v, positions
        else:
            self.keys = torch.cat([self.keys, k], dim=1)
            self.values = torch.cat([self.values, v], dim=1)
            self.positions = torch.cat([self.positions, positions])
        keys = self.keys.repeat_interleave(self.groups, dim=0)
        values = self.values.repeat_interleave(self.groups, dim=0)
        logits = torch.matmul(q, keys.transpose(1, 2)) / math.sqrt(dim)
        future = self.positions[None, :] > positions[:, None]
        logits = logits + torch.where(future, torch.finfo(logits.dtype).min, 0.0)
        weights = torch.softmax(logits, dim=-1, dtype=torch.float32)
        out = torch.matmul(weights, values)
        self._reduce(weights)
        return out

    def _reduce(self, weights: torch.Tensor) -> None:
        if weights.shape[-1] <= self.cache_size:
            return
        mean = torch.mean(weights[None, :, -1, :], dim=1)  # [1, L]: the batch dimension the release keeps
        _, ind = torch.topk(mean, k=self.cache_size, dim=-1)
        ind = torch.sort(ind).values[0]
        self.keys, self.values, self.positions = self.keys[:, ind], self.values[:, ind], self.positions[ind]

    def kept(self) -> list[int]:
        return self.positions.tolist()
