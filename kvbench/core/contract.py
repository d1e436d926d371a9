"""The contract types every layer shares: when a method evicts (`Schedule`), its budgets for a sample (`Plan`),
what a decode step attends to (`Selection`), a padded view of a layer (`HeadView`), and the per-forward
context handed to the attention function and the hooks (`Step`), with what that code uses of the step's cache
and method (`StepCache`, `StepMethod`, `StepSelector`: protocols, as this module sits below `kvbench.cache` and
`kvbench.methods`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch


@dataclass(frozen=True)
class Schedule:
    """When a method evicts. The engine owns the loop and follows this."""

    block_size: int | None  # None: the segment is one dense forward, evicted at its end
    decode_every: int  # evict after every N-th decode step; 0: the cache grows while decoding
    every_turn: bool = False  # also at the end of each later turn's input (RocketKV re-compresses per turn)

    @property
    def events(self) -> tuple[str, ...]:
        prefill = ("segment_end",) if self.block_size is None else ("prefill_block",)
        return prefill + (("turn_end",) if self.every_turn else ()) + (("decode_step",) if self.decode_every else ())


@dataclass(frozen=True)
class Plan:
    """A point's budget resolved for one sample."""

    evict: int | None  # tokens per KV head the eviction hook keeps (None: nothing is ever evicted)
    select: int | None  # per-step selection budget (None: every decode step attends to everything)
    derived: dict[str, Any] = dataclasses.field(default_factory=dict)  # parameters derived from the budget

    @classmethod
    def full_attention(cls) -> "Plan":
        """A budget at or above the sequence: nothing evicted, every step attends to everything."""
        return cls(evict=None, select=None, derived={"full_attention": True})


@dataclass
class Selection:
    """What a decode step attends to: `idx` [H_kv, G, k], per query head, the rows of the layer's storage.

    - `external`: (keys, values[, valid[, log_weights]]) [H_kv, m, D] ([H_kv, m] bool; [H_kv, G, m] fp32) from
      outside the layer's storage (CTKVR's host segment, OmniKV's context bank), attended by every query head
      of the group where the rows live; the two attentions merge exactly by log-sum-exp (the token sets must
      be disjoint). `log_weights` are added to each query head's logits of those rows (an importance-sampling
      estimator's -log p, MagicPIG; -inf: a row that query head did not sample).
    - `weight`, `fallback`: the output is blended, `weight * out + (1 - weight) * fallback` (SparQ's mean
      value); weight [H_kv, G, 1], fallback [H_kv, G or 1, D].
    - `recall`: the step's top-k attention recall when only the method sees every row (else measured by the
      dispatcher over the storage); `moved_bytes`: bytes this step moved between host and device; `extra`:
      the method's own per-step numbers (CTKVR's recall size), averaged over steps and layers in the record.
    """

    idx: torch.Tensor
    weight: torch.Tensor | None = None
    fallback: torch.Tensor | None = None
    external: tuple[torch.Tensor, torch.Tensor] | None = None
    recall: float | None = None
    moved_bytes: int = 0
    extra: dict[str, float] = dataclasses.field(default_factory=dict)  # method numbers, averaged in the record


@dataclass
class HeadView:
    """A padded `[H, L_max, D]` view of a layer plus a validity mask (None when no padding).

    On a layer in the static decode layout (`kvbench.cache.static`) the view spans the fixed capacity: `width`
    (L_max) is the capacity, `valid` marks the slots holding tokens and `lengths` holds each head's count on the
    device. Code that serves both layouts decides in Python by `width` only and masks by `valid`."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor  # [H, L_max], -1 on padding
    valid: torch.Tensor | None  # [H, L_max] bool
    lengths: torch.Tensor | None = None  # [H] int64 tokens per head (static layout); None: `valid` or width says

    @property
    def width(self) -> int:
        return self.keys.shape[1]


class StepCache(Protocol):
    """What the attention function uses of a step's cache (`kvbench.cache.KVBenchCache`): its layers, by layer index
    (`KVLayer`s; `Any` here, below the cache), and how many there are."""

    @property
    def layers(self) -> Sequence[Any]: ...

    @property
    def num_layers(self) -> int: ...


class StepMethod(Protocol):
    """What the attention function (`kvbench.attention`) and the layers' eviction (`KVLayer.evict`) call of a step's
    method (`kvbench.methods.base.Method`, whose docstrings say what each returns; one whose `selects` is True is a
    `StepSelector`). `layer` is a `KVLayer`."""

    selects: ClassVar[bool]

    @property
    def repeats_kv(self) -> bool: ...

    def is_dense_layer(self, layer_idx: int) -> bool: ...

    def layer_budget(self, layer: Any, budget: int, step: Step) -> int: ...

    def keep(self, layer: Any, budget: int, step: Step) -> list[torch.Tensor] | None: ...

    def decode_eviction_scores(self, layer: Any, budget: int, step: Step) -> tuple[torch.Tensor, Any]: ...

    def observe(self, layer: Any, queries: torch.Tensor, step: Step) -> None: ...

    def observe_step(self, layer: Any, queries: torch.Tensor, step: Step) -> None: ...

    def step_traffic(self, layer: Any, selection: Selection | None, step: Step) -> int | torch.Tensor: ...

    def chunk_context(self, layer: Any, query: torch.Tensor, step: Step,
                      scaling: float) -> tuple[torch.Tensor, torch.Tensor] | None: ...

    def chunk_attention(self, layer: Any, query: torch.Tensor, step: Step, scaling: float) -> torch.Tensor | None: ...

    def offloaded(self, layer: Any) -> Any: ...


class StepSelector(StepMethod, Protocol):
    """A step's method whose `selects` is True (`kvbench.methods.base.SelectionMethod`): the dispatcher also asks it
    what each decode step attends to."""

    def select(self, layer: Any, q: torch.Tensor, view: HeadView, step: Step,
               scaling: float) -> torch.Tensor | Selection | None: ...


@dataclass
class Step:
    """One forward pass over one cache, as the attention function and the method's hooks see it.

    The session builds one for every forward (and for the hooks it runs between forwards) and hands it to
    the model as `kvbench_steps` (one per batch row), which transformers passes through to the registered
    attention function; nothing about a step is stored on the cache. `cache` and `method` are the
    `KVBenchCache` and `Method`, typed by what the attention path uses of them (`StepCache`, `StepMethod`: this
    module sits below both); `method` is None for a run without a method.
    """

    cache: StepCache
    method: StepMethod | None = None
    plan: Plan | None = None
    evict: bool = False  # an eviction event: every layer evicts right after its attention
    observe: bool = False  # the method observes every attention call (H2O), while eviction can still happen
    query_window: int = 0  # queries each layer keeps for the method's scores (its observation window)
    measure_recall: bool = False  # selection methods: top-k attention-mass recall of this decode step
    shared: dict[str, Any] = dataclasses.field(default_factory=dict)  # the layers' common state (OmniKV)
    # the model's rotary embedding: logical positions [N] -> (cos, sin) [N, D] fp32, for methods that work on
    # pre-RoPE keys (ShadowKV's low-rank keys); None for a model without RoPE
    rotary: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None
    # the one source of randomness a method may draw from: a CPU generator of this sample, seeded from the run's
    # seed and the sample's id (`engine.sample.sample_generator`), shared by the sample's forwards and hooks in
    # order. So a stochastic method draws the same in a grouped run as alone, and on a rerun, and differently
    # for two samples. None: a step built without a session (a test's stand-in)
    generator: torch.Generator | None = None
    # the prompt's first forward's attention when it is not the model's dense causal attention (MInference's
    # sparse prefill, `engine.prefill_attention`): (layer index, query, keys, values, scaling) -> output
    prefill_attention: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor] | None = None

    @property
    def num_layers(self) -> int:
        return self.cache.num_layers

    @property
    def budget(self) -> int | None:
        """Tokens per KV head the eviction hook keeps (None: nothing is evicted)."""
        return self.plan.evict if self.plan is not None else None
