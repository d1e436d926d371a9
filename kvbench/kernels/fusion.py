"""`realized`: a fusion barrier for the compiled decode step.

Inductor inlines pointwise work into every kernel that reads it. For a decode query that is a trap: the rotary
embedding (`cos`/`sin` of position x inverse frequency, then `q * cos + rotate(q) * sin`) is pointwise, and
inductor lowers a product with a single query row on CPU to a multiply-and-sum, so an attention over gathered
rows recomputes the rotation, transcendental functions included, for every row it reads. In a compiled bf16
RocketKV step at 8K on two CPU cores that was 330 us of a layer's attention over 128 selected tokens
(docs/journal/cpu_decode.md). Passing the query through `realized` computes it once into its own buffer
(`kvbench.kernels.sparse_attention.topk_attention_traced` does where its products have one query row);
outside `torch.compile` it is the tensor itself, so the eager path is untouched.
"""

from __future__ import annotations

import torch


def realized(x: torch.Tensor) -> torch.Tensor:
    """`x`, computed into its own buffer when traced by `torch.compile` (an opaque copy that inductor cannot
    inline into its readers); `x` itself otherwise."""
    return _realized_op(x) if torch.compiler.is_compiling() else x


@torch.library.custom_op("kvbench::realized", mutates_args=())
def _realized_op(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@_realized_op.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)
