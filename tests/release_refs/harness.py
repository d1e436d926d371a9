"""Drive a kvbench method on raw tensors through the engine's own entry, for comparison with a release.

`TensorRun` holds a `KVBenchCache` and does what `Session` does around a forward, without a model: every layer
is updated with the given keys and values (`KVLayer.update`, as the model's attention module does) and then
attended through `kvbench_attention`, the function registered with transformers, with the `Step` a session
would hand it (the method's plan, its observation window, whether this forward is an eviction event). So the
method's `keep`, `observe`, `layer_budget` and `select` run exactly as in a real run; only the projections
around the attention are left out, which no method reads.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kvbench.attention.dispatch import kvbench_attention
from kvbench.cache.kvcache import KVBenchCache
from kvbench.core.contract import Step
from kvbench.methods.base import Method


def random_layer(seed: int, q_heads: int, kv_heads: int, length: int, dim: int, scale: float = 2.0):
    """Queries `[H_q, L, D]`, keys and values `[H_kv, L, D]`, float32. Keys and queries are scaled so that
    attention is peaked (as in a trained model) rather than nearly uniform, which would make every score tie."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(q_heads, length, dim, generator=gen) * scale
    k = torch.randn(kv_heads, length, dim, generator=gen) * scale
    v = torch.randn(kv_heads, length, dim, generator=gen)
    return q, k, v


class TensorRun:
    """One sequence's cache under one method, fed tensors instead of a model's activations."""

    def __init__(self, method: Method | None, budget: int | None, num_layers: int, head_dim: int,
                 sequence_length: int, new_tokens: int = 0):
        self.method = method
        self.cache = KVBenchCache(num_layers)
        self.plan = None
        if method is not None and budget is not None:
            self.plan = method.plan(budget, sequence_length=sequence_length, new_tokens=new_tokens,
                                    head_dim=head_dim, num_layers=num_layers)
        live = method is not None and method.schedule() is not None
        self.observe = live and method.observes
        self.query_window = method.obs_window if live else 0
        self.head_dim = head_dim

    def step(self, evict: bool) -> Step:
        return Step(self.cache, self.method, self.plan, evict=evict, observe=self.observe,
                    query_window=self.query_window, generator=torch.Generator().manual_seed(0))

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, evict: bool) -> torch.Tensor:
        """One layer's attention over a chunk: q `[H_q, n, D]`, k/v `[H_kv, n, D]`; returns `[H_q, n, D]`."""
        layer = self.cache.layers[layer_idx]
        # copies: the layer's first buffers may be views of what `update` is given (a model's fresh projections),
        # and an eviction that moves rows in place would then rewrite the caller's tensors
        keys, values = layer.update(k[None].clone(), v[None].clone())
        module = SimpleNamespace(layer_idx=layer_idx, head_dim=self.head_dim)
        out, _ = kvbench_attention(module, q[None], keys, values, None, scaling=self.head_dim ** -0.5,
                                   kvbench_steps=[self.step(evict)])
        return out[0].transpose(0, 1)

    def end_segment(self, keeps_state: bool) -> None:
        """What `Session.end_segment` does: keep the method's state only if later steps still evict, and build
        the derived state a selection reads."""
        self.observe = keeps_state and self.method.observes
        self.query_window = self.method.obs_window if keeps_state else 0
        self.cache.trim_method_state(self.query_window, drop_token_state=not keeps_state)
        step = self.step(False)
        for layer in self.cache.layers:
            if not layer.derived and layer.keys is not None:
                layer.derived = self.method.build_derived(layer, step)

    def kept(self, layer_idx: int) -> list[list[int]]:
        """Per stored head, the sorted positions it holds."""
        positions = self.cache.layers[layer_idx].head_view().positions
        return [sorted(p[p >= 0].tolist()) for p in positions]


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float) -> torch.Tensor:
    """Dense float32 attention of one query per head `[H_q, D]` over `[H_q, n, D]` rows (already repeated)."""
    probs = torch.softmax(torch.einsum("hd,hnd->hn", q, keys) * scaling, dim=-1)
    return torch.einsum("hn,hnd->hd", probs, values)


def jaccard(a: list[int], b: list[int]) -> float:
    sa, sb = set(a), set(b)
    return len(sa & sb) / len(sa | sb) if sa | sb else 1.0
