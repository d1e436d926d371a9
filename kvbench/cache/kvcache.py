"""`KVBenchCache`: the layers of one sequence, their byte accounting, clones that share storage, and the
decode statistics (`DecodeStats`) the attention function adds to."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import Cache

from kvbench.cache.layer import KVLayer


class KVBenchCache(Cache):
    """A transformers Cache of `KVLayer`s: storage and its accounting, nothing more.

    It never calls a method: the session decides what happens at each forward and says so in the `Step` it
    hands to the attention function, which runs the method's hooks on the layer it has just attended with.
    At an eviction event each layer evicts right after its own attention, so at peak only one layer holds its
    uncompressed KV plus the chunk, as in the reference implementations.
    """

    def __init__(self, num_layers: int):
        super().__init__(layers=[KVLayer(i, self) for i in range(num_layers)])
        self.stats = DecodeStats()
        self._kv_bytes = 0
        self.kv_peak_bytes = 0  # the most K/V bytes held at any moment

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def _account(self, delta: int) -> None:
        self._kv_bytes += delta
        self.kv_peak_bytes = max(self.kv_peak_bytes, self._kv_bytes)

    def trim_method_state(self, query_window: int, drop_token_state: bool) -> None:
        """Keep only the last `query_window` queries of every layer, and drop the method's per-token state."""
        for layer in self.layers:
            if drop_token_state:
                layer.drop_token_state()
            if layer.queries is not None and layer.queries.shape[1] > query_window:
                keep = layer.queries.shape[1] - query_window
                layer.queries = layer.queries[:, keep:].clone() if query_window else None
                layer.query_positions = layer.query_positions[keep:].clone() if query_window else None

    def nbytes(self) -> int:
        """Bytes of the distinct storages this cache holds: what eviction really freed, not a mask count."""
        seen: dict[int, int] = {}
        for layer in self.layers:
            for t in layer.tensors():
                storage = t.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
        return sum(seen.values())

    def kv_bytes(self) -> int:
        """Bytes of the keys and values of the tokens held (without positions or method state)."""
        return sum(layer.kv_nbytes() for layer in self.layers)

    def kv_capacity_bytes(self) -> int:
        """Bytes of the key and value buffers, the slack reserved for appends included."""
        return sum(layer.kv_capacity_nbytes() for layer in self.layers)

    def reserve(self, tokens: int) -> None:
        """Room for `tokens` more tokens in every layer, so that decoding them copies no layer."""
        for layer in self.layers:
            layer.reserve(tokens)

    def method_state_bytes(self) -> int:
        """Bytes of the method's own state: per-token tensors and the kept observation queries."""
        return sum(layer.method_state_nbytes() for layer in self.layers)

    def kept_per_head(self) -> list[list[int]]:
        return [layer.lengths() for layer in self.layers]

    def peak_entries_per_head(self) -> int:
        """The most tokens any head of any layer held at any moment (prefill blocks and decode included)."""
        return max((layer.peak_len for layer in self.layers), default=0)

    def evictions(self) -> int:
        """Eviction events that removed tokens (the most over layers)."""
        return max((layer.evictions for layer in self.layers), default=0)

    def truncate(self, logical_length: int) -> None:
        for layer in self.layers:
            layer.truncate(logical_length)
        self._kv_bytes = sum(layer.kv_nbytes() for layer in self.layers)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].seen if self.layers else 0

    def clone(self) -> "KVBenchCache":
        """A copy that shares the (never mutated in place) tensors: costs no memory until it diverges. Its
        decode statistics start empty."""
        copy = KVBenchCache(0)
        copy.layers = [layer.clone_into(copy) for layer in self.layers]
        copy._kv_bytes, copy.kv_peak_bytes = self._kv_bytes, self.kv_peak_bytes
        return copy


@dataclass
class DecodeStats:
    """What the decode steps of one cache read, by the method's own cost model, and how well selections
    recalled the exact top-k attention mass (both summed over layers; divide by `layer_steps`).

    A step's elements and attended rows may be 0-d tensors on the model's device (a selection's distinct
    tokens, counted where the selection lives): they are kept as they come and read once, when a total is
    asked for (at the end of a sample), so a decode step never waits for the device to report a count. The
    totals add the steps in their order either way (bitwise the sums of the numbers read one by one)."""

    layer_steps: int = 0
    moved_bytes: int = 0  # between host and device
    extra_sums: dict[str, float] = field(default_factory=dict)  # a method's own per-step numbers
    extra_steps: int = 0
    recall_sum: float = 0.0
    recall_steps: int = 0
    _read_elements: int = 0
    _read_token_equivalents: float = 0.0
    _attended_tokens: float = 0.0
    _unread: list[tuple[Any, Any, int]] = field(default_factory=list)  # (elements, attended, 2 D H_kv) per step

    def add(self, layer: "KVLayer", elements: "int | torch.Tensor", recall: float | None,
            attended: "float | torch.Tensor", moved_bytes: int = 0, extra: dict[str, float] | None = None) -> None:
        """One layer's decode step: `elements` read (the method's cost model), `attended` rows per query head."""
        self.layer_steps += 1
        self._unread.append((elements, attended, 2 * layer.head_dim * layer.model_kv_heads))
        self.moved_bytes += moved_bytes
        if extra:
            self.extra_steps += 1
            for key, value in extra.items():
                self.extra_sums[key] = self.extra_sums.get(key, 0.0) + value
        if recall is not None:
            self.recall_sum += recall
            self.recall_steps += 1

    @property
    def read_elements(self) -> int:
        """K/V and auxiliary elements read, all heads."""
        self._read_counts()
        return self._read_elements

    @property
    def read_token_equivalents(self) -> float:
        """read_elements / (2 D) per KV group: comparable to a token budget."""
        self._read_counts()
        return self._read_token_equivalents

    @property
    def attended_tokens(self) -> float:
        """K/V rows each query head attended, averaged over the query heads."""
        self._read_counts()
        return self._attended_tokens

    def _read_counts(self) -> None:
        steps, self._unread = self._unread, []
        read = iter(_host_numbers([c for step in steps for c in step[:2] if isinstance(c, torch.Tensor)]))
        for elements, attended, per_group in steps:
            elements = next(read) if isinstance(elements, torch.Tensor) else elements
            attended = next(read) if isinstance(attended, torch.Tensor) else attended
            self._read_elements += elements
            self._attended_tokens += attended
            self._read_token_equivalents += elements / per_group


def _host_numbers(counts: list[torch.Tensor]) -> list[Any]:
    """Python numbers of 0-d tensors, one transfer per device and dtype."""
    numbers: list[Any] = [None] * len(counts)
    for kind in {(c.device, c.dtype) for c in counts}:
        at = [i for i, c in enumerate(counts) if (c.device, c.dtype) == kind]
        for i, value in zip(at, torch.stack([counts[i] for i in at]).tolist()):
            numbers[i] = value
    return numbers
