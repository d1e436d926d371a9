"""What every claim measures from: one sample's full-cache run, with every layer's post-RoPE queries kept.

`capture` prefills the prompt on the common cache (method `full`, so no second model path), decodes greedily
for up to `new_tokens` tokens and keeps every query each layer attended with (the cache's query window set to
the whole sequence). Attention rows are then recomputed exactly in float32 from the stored queries and keys:
the prompt's queries and the decode steps' queries alike (`Trace.decode_queries`), since a decode step's query
is the query of the token fed at that step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench.engine.prompt import stop_token_ids
from kvbench.engine.session import Session
from kvbench.methods import build_method
from kvbench.models import LoadedModel


@dataclass
class LayerTrace:
    """One layer after the run: keys and values `[H_kv, L, D]` and queries `[H_q, L, D]` (float32), L the tokens
    held, and the layer's output projection `o_proj` `[hidden, H_q * D]`."""

    keys: torch.Tensor
    values: torch.Tensor
    queries: torch.Tensor
    scaling: float
    o_proj: torch.Tensor

    @property
    def group(self) -> int:
        return self.queries.shape[0] // self.keys.shape[0]

    def rows(self, positions: torch.Tensor, keys_upto: int | None = None) -> torch.Tensor:
        """Causal softmax rows `[H_q, r, n]` of the queries at `positions` over the first `n` keys (all of
        them by default); query p sees keys 0..p."""
        n = self.keys.shape[1] if keys_upto is None else keys_upto
        heads, dim = self.keys.shape[0], self.keys.shape[-1]
        q = self.queries[:, positions].view(heads, self.group * len(positions), dim)
        logits = torch.bmm(q, self.keys[:, :n].transpose(1, 2)).mul_(self.scaling)
        logits = logits.view(heads * self.group, len(positions), n)
        future = torch.arange(n)[None, :] > positions[:, None]
        return torch.softmax(logits.masked_fill_(future[None], float("-inf")), dim=-1)

    def outputs(self, positions: torch.Tensor, kept: torch.Tensor | None = None) -> torch.Tensor:
        """Attention outputs `[H_q, r, D]` of the queries at `positions`; `kept` `[H_kv, L]` (bool) masks the
        keys each KV head still holds (None: all of them)."""
        rows = self.rows(positions)
        if kept is not None:
            rows = rows * kept.repeat_interleave(self.group, 0)[:, None, :]
            rows = rows / rows.sum(-1, keepdim=True)
        values = self.values.repeat_interleave(self.group, 0)
        return torch.bmm(rows, values)


@dataclass
class Trace:
    """A sample's full-cache run: `prompt_len` prompt tokens, then `generated` (greedy)."""

    layers: list[LayerTrace]
    prompt_len: int
    generated: list[int]

    @property
    def decode_queries(self) -> torch.Tensor:
        """Positions of the decode steps' queries: the last prompt token's (it produced the first new token),
        then every generated token fed back."""
        return torch.arange(self.prompt_len - 1, self.prompt_len - 1 + len(self.generated))


def capture(lm: LoadedModel, ids: list[int], new_tokens: int = 0) -> Trace:
    """Prefill `ids` with the full cache, decode greedily up to `new_tokens` tokens (stopping at EOS) and keep
    every layer's keys, values and queries."""
    session = Session(lm, build_method("full"), None)
    session.query_window = len(ids) + new_tokens
    logits, _ = session.prefill(ids, compress=False)
    generated: list[int] = []
    if new_tokens > 0:
        generated = session.decode(logits, new_tokens, stop_token_ids(lm), [], 0)[0]
    layers = []
    for layer, block in zip(session.cache.layers, lm.model.model.layers):
        view = layer.head_view()
        layers.append(LayerTrace(view.keys.float(), view.values.float(), layer.queries.float(), float(layer.scaling),
                                 dense_weight(block.self_attn.o_proj)))
    return Trace(layers, len(ids), generated)


@torch.inference_mode()
def dense_weight(linear: torch.nn.Module) -> torch.Tensor:
    """A linear layer's weight `[out, in]` in float32, read through its forward (exact: each output of the
    identity is one weight), so a weight stored in oneDNN's blocked layout (bf16 on CPU) reads the same."""
    eye = torch.eye(linear.in_features, dtype=next(linear.parameters()).dtype, device=next(linear.parameters()).device)
    offset = linear(torch.zeros_like(eye[:1]))
    return (linear(eye) - offset).T.float()


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman's rank correlation of two 1-D tensors (average ranks for ties); NaN when either is constant."""
    ra, rb = _ranks(a.double()), _ranks(b.double())
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denom = ra.norm() * rb.norm()
    return float((ra * rb).sum() / denom) if denom > 0 else float("nan")


def _ranks(x: torch.Tensor) -> torch.Tensor:
    values, inverse, counts = torch.unique(x, return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).double()
    return ((ends - (counts.double() - 1) / 2))[inverse]


def share_for_mass(weights: torch.Tensor, mass: float) -> torch.Tensor:
    """The smallest fraction of entries (last dim) whose largest weights sum to `mass` of the row's total."""
    ordered = weights.sort(dim=-1, descending=True).values.cumsum(-1)
    needed = (ordered < mass * ordered[..., -1:]).sum(-1) + 1
    return needed.double() / weights.shape[-1]
