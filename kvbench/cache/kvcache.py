"""`KVBenchCache`: the layers of one sequence, their byte accounting, clones that share storage, and the
decode statistics (`DecodeStats`) the attention function adds to."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import Cache

from kvbench.cache.dynamic import DynamicKVLayer
from kvbench.cache.layer import KVLayer
from kvbench.cache.static import StaticCounters, StaticKVLayer


class KVBenchCache(Cache):
    """A transformers Cache of `KVLayer`s (`DynamicKVLayer`s, `StaticKVLayer`s during a static decode loop):
    storage and its accounting, nothing more.

    It never calls a method of its own accord: the session decides what happens at each forward and says so in the
    `Step` it hands to the attention function, which runs the method's hooks on the layer it has just attended with
    (an eviction through `KVLayer.evict`, which asks the method the hook of the layer's layout).
    At an eviction event each layer evicts right after its own attention, so at peak only one layer holds its
    uncompressed KV plus the chunk, as in the reference implementations.
    """

    def __init__(self, num_layers: int):
        super().__init__(layers=[DynamicKVLayer(i, self) for i in range(num_layers)])
        self.stats = DecodeStats()
        self._kv_bytes = 0
        self.kv_peak_bytes = 0  # the most K/V bytes held at any moment
        # the static decode layout (`make_static` .. `make_dynamic`): device byte counters, the step's position
        self.static_counters: StaticCounters | None = None
        self.static_position: torch.Tensor | None = None  # [1] int64, the decode token's position (set per step)

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

    @property
    def is_static(self) -> bool:
        return self.static_counters is not None

    def make_static(self, tokens: int, query_window: int, query_heads: int, ragged: bool = False,
                    tight: bool = False) -> None:
        """Every layer into the static decode layout for a loop of up to `tokens` decode steps (see
        `kvbench.cache.static`; `ragged`: every layer flat; `tight`: linear capacity steps, `StaticKVLayer.enter`):
        each becomes a `StaticKVLayer`, the same object. The byte accounting and decode statistics onto the
        device."""
        device = self.layers[0].buffers["keys"].device
        for layer in self.layers:
            StaticKVLayer.enter(layer, tokens, query_window, query_heads, ragged, tight)
        as_tensor = lambda n: torch.tensor(n, dtype=torch.int64, device=device)  # noqa: E731
        self.static_counters = StaticCounters(as_tensor(self._kv_bytes), as_tensor(self.kv_peak_bytes))
        self.static_position = torch.zeros(1, dtype=torch.int64, device=device)
        self.stats.make_static(device)
        if device.type == "cuda":  # written in place by the step: a CUDA graph keeps them at their addresses (no
            for tensor in self.static_tensors():  # guard on the address: a new sample re-records, never recompiles)
                torch._dynamo.mark_static_address(tensor, guard=False)

    def static_tensors(self) -> list[torch.Tensor]:
        """Every tensor a static decode step writes in place (CUDA graphs need them at static addresses)."""
        tensors = [*self.static_counters.__dict__.values(), *self.stats.device_tensors()]
        for layer in self.layers:
            st = layer.static
            tensors += [*layer.buffers.values(), st.fill, st.next_slot, st.peak, st.evictions]
            tensors += [t for t in (layer.queries, layer.query_positions, layer.query_slot) if t is not None]
            for state in layer.derived.values():
                tensors += state.static_tensors()
        return tensors

    def static_advance(self, tokens: int = 1) -> None:
        """The host's side of `tokens` static decode steps: the logical length every layer reports."""
        for layer in self.layers:
            layer.seen += tokens

    def make_dynamic(self) -> None:
        """Back to the eager layout after a static decode loop (every layer a `DynamicKVLayer` again, the same object):
        the device numbers read back in one transfer."""
        parts = [t for layer in self.layers for t in layer.static_host_numbers()]
        counters = self.static_counters
        numbers = torch.cat([*parts, torch.stack([counters.kv_bytes, counters.kv_peak_bytes])]).tolist()
        at = 0
        for layer in self.layers:
            heads = layer.num_heads
            fill, next_slot = numbers[at:at + heads], numbers[at + heads:at + 2 * heads]
            peak, evictions = numbers[at + 2 * heads:at + 2 * heads + 2]
            at += 2 * heads + 2
            layer.make_dynamic(fill, next_slot, peak, evictions)
        self._kv_bytes, self.kv_peak_bytes = numbers[at], numbers[at + 1]
        self.static_counters = self.static_position = None
        self.stats.make_dynamic()

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
    _device: dict[str, torch.Tensor] | None = None  # the totals of static decode steps, on the device

    def add(self, layer: "KVLayer", elements: "int | torch.Tensor", recall: "float | torch.Tensor | None",
            attended: "float | torch.Tensor", moved_bytes: int = 0, extra: dict[str, float] | None = None,
            recall_counts: "torch.Tensor | None" = None) -> None:
        """One layer's decode step: `elements` read (the method's cost model), `attended` rows per query head.
        On a static layer the numbers go to device totals (`recall_counts`: whether this step's recall counts:
        a selection that holds every token is full attention, whose recall the eager path does not measure)."""
        if self._device is not None:
            self._add_on_device(layer, elements, recall, attended, moved_bytes, extra, recall_counts)
            return
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

    def make_static(self, device: torch.device) -> None:
        # shape [1], not 0-d: inductor (torch 2.13, CPU) drops in-place adds to a 0-d float64 graph input
        zero = lambda dtype: torch.zeros(1, dtype=dtype, device=device)  # noqa: E731
        self._device = {"layer_steps": zero(torch.int64), "elements": zero(torch.int64),
                        "token_equivalents": zero(torch.float64), "attended": zero(torch.float64),
                        "recall_sum": zero(torch.float64), "recall_steps": zero(torch.int64)}

    def device_tensors(self) -> list[torch.Tensor]:
        return list(self._device.values()) if self._device is not None else []

    def _add_on_device(self, layer, elements, recall, attended, moved_bytes, extra, recall_counts) -> None:
        if moved_bytes or extra:
            raise RuntimeError("a static decode step moves no bytes between host and device and reports no "
                               "method numbers: the method must stay on the eager path")
        d = self._device
        d["layer_steps"].add_(1)
        d["elements"].add_(elements)
        d["token_equivalents"].add_(torch.as_tensor(elements, dtype=torch.float64) / (2 * layer.head_dim * layer.model_kv_heads))
        d["attended"].add_(attended)
        if recall is not None:
            counts = torch.ones((), dtype=torch.bool) if recall_counts is None else recall_counts
            d["recall_sum"].add_(torch.where(counts, torch.as_tensor(recall, dtype=torch.float64), 0.0))
            d["recall_steps"].add_(counts.to(torch.int64))

    def make_dynamic(self) -> None:
        """The static steps' totals read back (after the steps counted before them, in order)."""
        self._read_counts()
        d, self._device = self._device, None
        steps, elements, recall_steps = torch.cat([d["layer_steps"], d["elements"], d["recall_steps"]]).tolist()
        equivalents, attended, recall_sum = torch.cat([d["token_equivalents"], d["attended"], d["recall_sum"]]).tolist()
        self.layer_steps += steps
        self._read_elements += elements
        self._read_token_equivalents += equivalents
        self._attended_tokens += attended
        self.recall_sum += recall_sum
        self.recall_steps += recall_steps

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
