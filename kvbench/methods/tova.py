"""TOVA (Oren et al. 2024): keep the tokens the newest query attends to most.

At each eviction event the layer's last query (the last token of the segment or prefill block, or the
decode token) scores every stored token by its softmax attention (fp32, over all stored tokens, itself
included); each KV head keeps its top `budget`, so at a decode step with budget + 1 entries the argmin goes.

`head_agg=group` (default) averages the attention over the query heads of each KV group and selects per KV
head, as the KeyDiff paper's TOVA baseline (KeyDiff §4, App. F.2). `head_agg=layer` averages over
all heads of the layer and keeps the same tokens in every head, as the TOVA paper and kvpress's TOVAPress do
(kvpress also always keeps the newest token and scores the rest with its column dropped; here the newest
token competes by its own attention weight).

Against the release (schwartz-lab-NLP/TOVA, `head_agg=layer`) on the same tensors, and what the `group`
default changes: docs/fidelity.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench.methods.base import ScoredEviction, register_method


def last_query_attention(layer) -> torch.Tensor:
    """Group-mean softmax attention of the layer's newest query over its stored tokens, `[H, L_max]`."""
    view = layer.head_view()
    heads = view.keys.shape[0]
    q = layer.recent_queries(1)[0][:, 0].float().view(heads, -1, view.keys.shape[-1])  # [H, G, D]
    logits = torch.einsum("hgd,hld->hgl", q, view.keys.float()) * layer.scaling
    if view.valid is not None:
        logits.masked_fill_(~view.valid[:, None, :], float("-inf"))
    return torch.softmax(logits, dim=-1).mean(dim=1)


@register_method
@dataclass
class TOVA(ScoredEviction):
    name = "tova"
    head_agg: str = "group"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.head_agg not in ("group", "layer"):
            raise ValueError(f"head_agg must be group or layer, not {self.head_agg!r}")

    @property
    def obs_window(self) -> int:
        return 1

    def score(self, layer, step):
        scores = last_query_attention(layer)
        if self.head_agg == "layer":
            scores = scores.mean(dim=0, keepdim=True).expand_as(scores)
        return scores
