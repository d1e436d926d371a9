"""KeyDiff App. C.2, Fig. 12: the keys KeyDiff keeps span a larger volume than those TOVA and Sink keep ("the
distribution of volumes for KeyDiff attains higher values, indicating that the retained keys are more
distinctive").

Per sample, layer and KV head, each policy runs block prompt processing over the prompt's keys: blocks of
`block` tokens are appended and the cache is cut back to `budget` after each, KeyDiff by `keydiff_scores` (its
default: cosine to the mean cached key), TOVA by the group mean of the block's last query's attention over the
cached keys (`kvbench.methods.tova`'s score), Sink by StreamingLLM's rule (4 sinks and the most recent tokens).
Each layer sees the full-cache run's keys, so its cache is its own eviction's, not an earlier layer's carried
forward (as every claim's layers do).

The volume is the log determinant of the Gram matrix of the kept keys, each normalised to unit length:
G = K^T K / B (D x D), plus 1e-6 I. App. F.1 gives no formula, and with B > D the B x B Gram K K^T is singular,
so this is kvbench's reading; unit keys make it a measure of how spread their directions are, which is what
"distinctive" says. App. F.1's budget and block size are lost in the text: kvbench keeps a quarter of each prompt (Qasper's prompts
run from about 2K to over 20K tokens, so no one number of tokens evicts from all of them; a budget of 1 or more
is tokens) and blocks of 128 (KeyDiff's block size).

The effect of a sample is the share of (layer, KV head) in which KeyDiff's volume is the largest of the three.
Verdict rule: holds when that share is above one half ("attains higher values").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from kvbench.analysis.base import Claim, register_claim
from kvbench.analysis.figures import new_figure
from kvbench.analysis.trace import LayerTrace, Trace
from kvbench.methods.keydiff import keydiff_scores
from kvbench.tasks.base import Sample

POLICIES = ("keydiff", "tova", "sink")


def block_eviction(layer: LayerTrace, n: int, budget: int, block: int, policy: str) -> torch.Tensor:
    """The prompt rows `[H_kv, budget]` each KV head holds after block prompt processing of its first `n` keys."""
    keys = layer.keys[:, :n]
    heads, _, dim = keys.shape
    if policy == "sink":
        sinks = min(4, budget)
        return torch.cat([torch.arange(sinks), torch.arange(n - (budget - sinks), n)]).expand(heads, -1)
    held = torch.empty(heads, 0, dtype=torch.long)
    for start in range(0, n, block):
        end = min(start + block, n)
        held = torch.cat([held, torch.arange(start, end).expand(heads, -1)], dim=1)
        if held.shape[1] <= budget:
            continue
        cached = keys.gather(1, held[..., None].expand(-1, -1, dim))
        if policy == "keydiff":
            scores = keydiff_scores(cached)
        else:  # tova: the block's last query, its group's mean attention
            q = layer.queries[:, end - 1].view(heads, layer.group, dim)
            scores = torch.softmax(torch.einsum("hgd,hld->hgl", q, cached) * layer.scaling, dim=-1).mean(dim=1)
        held = held.gather(1, scores.topk(budget, dim=-1).indices.sort(dim=-1).values)
    return held


def key_volume(keys: torch.Tensor) -> torch.Tensor:
    """log det of the Gram matrix of unit keys `[H, B, D]`, K^T K / B + 1e-6 I, per head `[H]` (float64)."""
    unit = F.normalize(keys.double(), dim=-1)
    gram = unit.transpose(1, 2) @ unit / keys.shape[1]
    return torch.linalg.slogdet(gram + 1e-6 * torch.eye(keys.shape[-1], dtype=gram.dtype)).logabsdet


@register_claim
@dataclasses.dataclass
class KeyDiffKeyVolume(Claim):
    name = "keydiff_key_volume"
    paper = "KeyDiff"
    source = "App. C.2, Fig. 12"
    statement = "the keys KeyDiff retains span a larger volume (log det of their Gram matrix) than TOVA's and Sink's"
    paper_number = "KeyDiff's distribution higher than TOVA's and Sink's (Llama-3.2-3B, 100 Qasper prompts)"
    effect_name = "share of (layer, KV head) where KeyDiff's volume is the largest"
    threshold = 0.5
    holds_when = "above"
    budget: float = 0.25  # a share of the prompt; 1 or more: tokens per KV head
    block: int = 128

    def measure(self, trace: Trace, sample: Sample, seed: int) -> dict[str, Any]:
        n = trace.prompt_len
        budget = round(self.budget * n) if self.budget < 1 else int(self.budget)
        if budget >= n:
            raise ValueError(f"budget {budget} tokens evicts nothing from a {n}-token prompt: give a smaller budget")
        volumes: dict[str, list[list[float]]] = {policy: [] for policy in POLICIES}
        for layer in trace.layers:
            for policy in POLICIES:
                held = block_eviction(layer, n, budget, self.block, policy)
                kept = layer.keys.gather(1, held[..., None].expand(-1, -1, layer.keys.shape[-1]))
                volumes[policy].append(key_volume(kept).tolist())
        table = {policy: np.asarray(v) for policy, v in volumes.items()}  # [layers, H_kv]
        largest = table["keydiff"] > np.maximum(table["tova"], table["sink"])
        return {"effect": float(largest.mean()), "budget_tokens": budget, "volumes": volumes,
                **{f"median_{policy}": float(np.median(v)) for policy, v in table.items()}}

    def figure(self, records: Sequence[dict[str, Any]]) -> Any:
        fig, ax = new_figure()
        for policy in POLICIES:
            pooled = np.concatenate([np.asarray(r["volumes"][policy]).ravel() for r in records])
            ax.hist(pooled, bins=40, alpha=0.5, label=policy)
        ax.set_xlabel("log det of the kept keys' Gram matrix (per layer and KV head)")
        ax.set_ylabel("count")
        ax.set_title("KeyDiff Fig. 12: volume spanned by the kept keys")
        ax.legend(fontsize=8)
        return fig
