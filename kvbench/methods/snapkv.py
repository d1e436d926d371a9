"""SnapKV (Li et al. 2024) in the GQA-aware form used by Ada-KV and RocketKV.

The last `window` queries the layer attended with (the observation window) score every earlier key: softmax
attention (fp32, causal inside the window), averaged over the window queries, aggregated over the query
heads of each KV group (`gqa_agg`: mean, the Ada-KV default, or max), then smoothed along the sequence with
a 1-D pool (`pooling`, `kernel`). Each KV head keeps its top `budget - window` tokens by pooled score plus
the whole window, in original order.

Defaults follow the Ada-KV reference framework (window 32, max-pool kernel 7, group mean) so that SnapKV and
Ada-SnapKV differ only in budget allocation. The original SnapKV code and kvpress use average pooling; set
`pooling=avg` for it. RocketKV's stage 1 uses kernel 63 with window sums (sum and mean rank identically).
When `budget <= window` the head keeps only the last `budget` tokens (the window no longer fits).

`granularity=head` is RocketKV's SnapKV baseline (RocketKV App. A.3): no GQA sharing, each query head
keeps its own `budget // G` tokens (window included), so a group still stores `budget` tokens, as G
separate copies: every KV head is split into one stored head per query head, and the bytes say so.

Block-wise and decode-time eviction (`block_size`, `decode_every`): the observation window is always the
last `window` queries the layer saw, across blocks and decode steps (kvbench's reading of KeyDiff's block
processing with SnapKV, §4: a rolling buffer of 32 queries, the 32 most recent tokens always kept).

Against the releases (FasterDecoding/SnapKV per query head, KVCache-Factory's kv_head mode per KV head), on
the same tensors: docs/fidelity.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvbench.methods.base import EvictionMethod, register_method


def window_scores(
    obs_queries: torch.Tensor,
    keys: torch.Tensor,
    scaling: float,
    gqa_agg: str = "mean",
    query_positions: torch.Tensor | None = None,
    key_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Window-mean attention of the observation queries to the keys before the window.

    obs_queries: [H_q, w, D], the layer's last w queries; keys: [H, L, D] whose last w rows are the window's
    own tokens. Query head h*G + g belongs to head h (transformers' repeat_kv order). Returns [H, L - w] in
    fp32, or [H_q, L - w] per query head for `gqa_agg="none"`. A window query sees the keys at or before its
    own position: by logical positions when given ([w] and [H, L]), else by index (query i is row L - w + i).
    """
    n_q, w, dim = obs_queries.shape
    n_kv, length, _ = keys.shape
    group = n_q // n_kv
    q = obs_queries.float().reshape(n_kv, group * w, dim)
    logits = torch.bmm(q, keys.float().transpose(1, 2)).mul_(scaling).view(n_kv, group, w, length)
    if query_positions is None or key_positions is None:
        row = torch.arange(w, device=keys.device)[:, None]
        col = torch.arange(length, device=keys.device)[None, :]
        future = col > length - w + row
    else:
        future = key_positions[:, None, None, :] > query_positions[None, None, :, None]
    logits.masked_fill_(future, float("-inf"))
    probs = torch.softmax(logits, dim=-1)[..., : length - w].mean(dim=2)  # [H, G, L - w]
    if gqa_agg == "mean":
        return probs.mean(dim=1)
    if gqa_agg == "max":
        return probs.amax(dim=1)
    if gqa_agg == "none":
        return probs.reshape(n_q, length - w)
    raise ValueError(f"gqa_agg must be mean, max or none, not {gqa_agg!r}")


def pool_scores(scores: torch.Tensor, pooling: str, kernel: int) -> torch.Tensor:
    if kernel <= 1:
        return scores
    if pooling == "max":
        return F.max_pool1d(scores[:, None], kernel, stride=1, padding=kernel // 2)[:, 0]
    if pooling == "avg":
        return F.avg_pool1d(scores[:, None], kernel, stride=1, padding=kernel // 2)[:, 0]
    raise ValueError(f"pooling must be max or avg, not {pooling!r}")


def with_window(top: torch.Tensor, length: int, window: int) -> torch.Tensor:
    """Sorted kept indices: the chosen ones plus the last `window` positions."""
    tail = torch.arange(length - window, length, device=top.device)
    return torch.cat([top.sort().values, tail])


@register_method
@dataclass
class SnapKV(EvictionMethod):
    name = "snapkv"
    window: int = 32
    kernel: int = 7
    pooling: str = "max"
    gqa_agg: str = "mean"
    granularity: str | None = None  # group (null): one selection per KV head (GQA-aware); head: per query head

    def __post_init__(self) -> None:
        super().__post_init__()
        self.granularity = self.granularity or "group"
        if self.window < 1:
            raise ValueError(f"window must be a positive number of observation queries, got {self.window!r}")
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError(f"kernel must be a positive odd pooling width (1: no pooling), got {self.kernel!r}")
        if self.pooling not in ("max", "avg"):
            raise ValueError(f"pooling must be max or avg, not {self.pooling!r}")
        if self.gqa_agg not in ("mean", "max"):
            raise ValueError(f"gqa_agg must be mean or max, not {self.gqa_agg!r}")
        if self.granularity not in ("group", "head"):
            raise ValueError(f"granularity must be group or head, not {self.granularity!r}")

    @property
    def obs_window(self) -> int:
        return self.window

    def pooled_scores(self, layer, window: int, gqa_agg: str | None = None) -> torch.Tensor:
        """Pooled window scores of every head's tokens before its window, `[H, n]`.

        Ragged layers (Ada-KV evicting again after a block or a decode step) are scored head by head on
        each head's own tokens; entries past a head's own candidates are -inf.
        """
        agg = gqa_agg or self.gqa_agg
        queries, query_positions = layer.recent_queries(window)
        if not layer.is_ragged:
            view = layer.head_view()
            scores = window_scores(queries, view.keys, layer.scaling, agg, query_positions, view.positions)
            return pool_scores(scores, self.pooling, self.kernel)
        view = layer.head_view()
        group = queries.shape[0] // layer.num_heads
        lens = layer.lengths()
        out = torch.full((layer.num_heads, max(lens) - window), float("-inf"), device=view.keys.device)
        for h, n in enumerate(lens):
            keys, positions = view.keys[h, :n][None], view.positions[h, :n][None]
            head = window_scores(queries[h * group:(h + 1) * group], keys, layer.scaling, agg, query_positions, positions)
            out[h, : n - window] = pool_scores(head, self.pooling, self.kernel)[0]
        return out

    def keep(self, layer, budget, step):
        length = layer.physical_length()
        n_q = layer.queries.shape[0]
        if self.granularity == "head":
            # one stored head per query head, each holding budget // G tokens of its own
            per_head, heads, agg = max(1, budget // (n_q // layer.model_kv_heads)), n_q, "none"
            if (per_head if layer.num_heads == n_q else budget) >= length:
                return None
        else:
            per_head, heads, agg = budget, layer.num_heads, self.gqa_agg
            if budget >= length:
                return None
        window = min(self.window, per_head)
        if window == per_head:
            tail = torch.arange(length - window, length, device=layer.keys.device)
            return [tail] * heads
        scores = self.pooled_scores(layer, window, agg)
        top = scores.topk(per_head - window, dim=-1).indices
        return [with_window(t, length, window) for t in top]
