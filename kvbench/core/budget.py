"""Budget units: tokens per KV head, a ratio of the compressed segment, or kvpress's compression ratio."""

from __future__ import annotations

from dataclasses import dataclass

from kvbench.core.errors import KVBenchError


@dataclass(frozen=True)
class CompressionRatio:
    """kvpress's budget convention: the fraction of the compressed segment's tokens removed."""

    value: float

    def __str__(self) -> str:
        return f"cr={self.value}"


def resolve_budget(budget: "float | int | CompressionRatio", length: int) -> int:
    """Tokens per KV head. An integer is taken as is; a float in (0, 1) is a fraction of `length` kept;
    a `CompressionRatio` keeps int(length * (1 - ratio)) tokens, kvpress's rounding (at least 1)."""
    if isinstance(budget, CompressionRatio):
        return max(1, int(length * (1 - budget.value)))
    if budget is None or budget <= 0:
        raise KVBenchError(f"budget must be positive (tokens per KV head, or a ratio in (0, 1)); got {budget}")
    if is_relative(budget):
        return max(1, round(budget * length))
    if isinstance(budget, float) and not budget.is_integer():
        raise KVBenchError(f"budget {budget} is neither a token count nor a ratio in (0, 1)")
    return int(budget)


def canonical_budget(budget: "float | int | None") -> "float | int | None":
    """A token count written as a float (`budget=1e3`, `budget=1024.0`) is that integer: the same point, the same
    directory and records as `budget=1024`. Ratios, non-integral floats (refused by the checks) and other values
    are returned as they are."""
    if isinstance(budget, float) and budget > 1 and budget.is_integer():
        return int(budget)
    return budget


def is_relative(budget: "float | int | CompressionRatio") -> bool:
    """Whether `budget` is a share of each sample's segment (a ratio, kvpress's compression ratio), so that its
    token count differs from one prompt length to the next."""
    return isinstance(budget, CompressionRatio) or (isinstance(budget, float) and 0 < budget < 1)
