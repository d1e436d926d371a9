"""The method interface: a method is a small dataclass that says when it evicts and which tokens it keeps.

Every hook is optional and gets the forward's `Step` (its plan, shared state, layer count); the session, the
attention function and the layer's `evict` (for `attention.hooks.evict_layer`) call them, never the other way round:

- `schedule()`: the events at which the method evicts (`EvictionMethod`: from `block_size`, `decode_every`).
- `keep(layer, budget, step)`: per layer at each eviction event, the sorted indices each head keeps, or None.
  The layer gathers keys, values, positions and token state with them, so the rest is really freed.
- `layer_budget(layer, budget, step)`: one layer's budget (PyramidKV); the identity by default.
- `observe(layer, queries, step)` with `observes = True`: after every attention call while eviction can
  still happen (H2O); state in `layer.token_tensor(name)`, replaced, never modified in place.
- `plan(budget, sequence_length=, new_tokens=, head_dim=)`: once per sample, the budgets and derived
  parameters (RocketKV's decomposition, Quest's page size), recorded with the sample.
- `select(layer, q, view, step, scaling)`, a `SelectionMethod`'s (`selects = True`): every decode step,
  `[H_kv, G, k]` indices (or a `Selection`), None for all tokens.
- `chunk_context(layer, query, step, scaling)`: the past rows a multi-token chunk on top of the cache attends
  to besides itself (None: everything, the dense default; OmniKV-prefill).
- `chunk_attention(layer, query, step, scaling)`: a multi-token chunk's whole attention output, where each of
  its rows sees the past differently (InfLLM's chunked prefill); None: the dispatcher's.
- `build_derived(layer, step)`: state a selection reads (page summaries), kept current by its own
  `append` / `truncate`; `step_traffic(layer, selection, step)`: elements one decode step reads.
- `decode_eviction_scores(layer, budget, step)`: a decode step's eviction on the static layout (below).

The static decode layout (`kvbench.cache.static`, `engine.compile`): a decode loop can run as one compiled
graph, in which no Python number changes from step to step. A method that only evicts at the end of the
prompt runs there as it is. A method with decode-time eviction runs there through
`decode_eviction_scores` (`ScoredEviction` derives it from `score`), a selecting method once its `select`,
`step_traffic` and derived state are written for fixed shapes (`static_selection`: decide in Python by
`view.width` only, mask by `view.valid`, read lengths from `view.lengths`). `static_decode_blocker` says why a
method stays on the eager path (host work every step: a CPU index, an LRU, host memory), and the record says so.

A method that draws at random draws from `step.generator` only: the sample's CPU generator, seeded from the
run's seed and the sample's id, so its choices are the same in a grouped run as alone, and on a rerun, and
differ between two samples of the same length (docs/adding-a-method.md, section 6; `methods/random.py`).

Every method has `dense_layers` (null: none; N: the first N layers; a list: those layer indices): a dense layer
keeps its whole cache and attends densely, whatever the method (RocketKV App. A.1 skips layers 0-1 for every
method on LongChat; Quest's release keeps its first two layers dense). The dispatcher and the eviction hook ask
`is_dense_layer`, so no method's own code checks it.

Budgets are tokens per KV head (the RocketKV / Ada-KV unit); for selection methods the per-step, per-KV-group
token budget, the estimate's traffic counted. A budget at or above what is stored means nothing to evict.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from kvbench.core.checks import check_field_kinds, is_int
from kvbench.core.contract import HeadView, Plan, Schedule, Selection, Step
from kvbench.kernels.distinct_rows import distinct_rows

if TYPE_CHECKING:
    from kvbench.cache.layer import KVLayer

METHODS: dict[str, type["Method"]] = {}


def register_method(cls: type["Method"]) -> type["Method"]:
    METHODS[cls.name] = cls
    return cls


@dataclass
class Method:
    name: ClassVar[str] = "base"
    family: ClassVar[str] = "none"  # eviction | selection | two-stage | none
    selects: ClassVar[bool] = False
    observes: ClassVar[bool] = False
    last_prompt_token_via_decode: ClassVar[bool] = False  # the prompt's last token goes through decode (RocketKV)
    steps_through_chunks: ClassVar[bool] = False  # later chunks (question, turns) go token by token (CTKVR)
    uses_budget: ClassVar[bool] = True  # False: the budget cannot change a result (full), so sweeps share one point
    host_work: ClassVar[str | None] = None  # the host work every decode step needs (keeps it off the static layout)
    # each decode step reads every key to choose what it attends, a read its cost model (`step_traffic`) leaves
    # out: an oracle (Exact-TopK) is counted by what it attends, as RocketKV counts it
    scores_every_key: ClassVar[bool] = False
    # its heads may keep different numbers of tokens (Ada-KV, DuoAttention): the static layout keeps every layer
    # flat then, so that a layer whose heads happen to come out even does not make a sample its own graph
    ragged_layers: ClassVar[bool] = False
    dense_layers: int | list[int] | None = None

    def __post_init__(self) -> None:
        # every field holds the kind its annotation says (an int field a whole number, ...): no method writes
        # that check; each checks its fields' ranges after this
        check_field_kinds(self)
        dense = self.dense_layers
        if any(x < 0 for x in ([] if dense is None else [dense] if is_int(dense) else dense)):
            raise ValueError("dense_layers must be null, a number of first layers >= 0 or a list of layer indices, "
                             f"got {dense!r}")
        if isinstance(dense, tuple):
            self.dense_layers = list(dense)

    def is_dense_layer(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` keeps its whole cache and attends densely (`dense_layers`)."""
        dense = self.dense_layers
        if dense is None:
            return False
        return layer_idx < dense if is_int(dense) else layer_idx in dense

    @property
    def repeats_kv(self) -> bool:
        """Whether dense decode attention reads K/V repeated to every query head (gpt-fast's dense baseline)."""
        return False

    @property
    def obs_window(self) -> int:
        """How many of the latest queries `keep` reads from `layer.queries` (0: none)."""
        return 0

    def schedule(self) -> Schedule | None:
        return None

    def static_decode_blocker(self) -> str | None:
        """Why this method's decode steps cannot run on the static layout as one compiled graph (None: they
        can). A method whose every step needs host work says what that work is."""
        if self.host_work is not None:
            return self.host_work
        schedule = self.schedule()
        if schedule is not None and schedule.decode_every:
            if schedule.decode_every != 1:
                return (f"evicting every {schedule.decode_every} decode steps drops several tokens per head at once; "
                        "the static layout evicts one per step (decode_every=1)")
            if type(self).decode_eviction_scores is Method.decode_eviction_scores:
                return f"{self.name}'s decode-time eviction has no fixed-shape form (decode_eviction_scores)"
        return None

    def decode_eviction_scores(self, layer: "KVLayer", budget: int, step: Step) -> "tuple[torch.Tensor, Any]":
        """A decode step's eviction on a layer in the static layout: `[H, width]` scores of its slots (higher
        keeps; `+inf`: never evicted) and the tokens each head keeps (an int, or `[H]`). Every head holding more
        loses its lowest-scored slot. Rows are not in position order there: what means "recent" reads
        `layer.head_view().positions`."""
        raise NotImplementedError

    def plan(self, budget: int, *, sequence_length: int, new_tokens: int, head_dim: int,
             num_layers: int | None = None) -> Plan:
        """This sample's budgets. `sequence_length`: its prompt plus the tokens it may generate, capped at the
        model's limit (RocketKV's S); `new_tokens`: the first turn's generation budget; `num_layers`: the
        model's depth (OmniKV's memory share)."""
        return Plan(evict=budget, select=budget if self.selects else None)

    def layer_budget(self, layer: "KVLayer", budget: int, step: Step) -> int:
        return budget

    def build_derived(self, layer: "KVLayer", step: Step) -> dict[str, Any]:
        return {}

    def offloaded(self, layer: "KVLayer") -> Any:
        """The rows this method moved off the layer's device storage (a `HostSegment`), or None: a dense
        chunk appended later (a question, a turn) attends to them too."""
        return None

    def chunk_context(self, layer: "KVLayer", query: torch.Tensor, step: Step,
                      scaling: float) -> "tuple[torch.Tensor, torch.Tensor] | None":
        """For a multi-token chunk attended on top of a cache (a prefill block, a question, a turn; `query`
        `[H_q, q, D]`): the past keys and values `[H_kv, m, D]` the chunk attends to besides itself, causally,
        or None for everything the layer holds (dense). OmniKV-prefill."""
        return None

    def chunk_attention(self, layer: "KVLayer", query: torch.Tensor, step: Step,
                        scaling: float) -> torch.Tensor | None:
        """For a multi-token chunk (`query` `[H_q, q, D]`, its keys already stored: the first prefill chunk
        included), the method's own attention output `[H_q, q, D]`, when what a row sees depends on the row in a way
        `chunk_context` cannot say (InfLLM: each row its own local window, the rest at another position); None for
        the dispatcher's. Called before `chunk_context`, on the layers that are not `dense_layers`."""
        return None

    def step_traffic(self, layer: "KVLayer", selection: "Selection | None", step: Step) -> int:
        """Elements one decode step reads in this layer: every stored key and value for dense attention, the
        distinct selected tokens of each KV group otherwise (the oracle's view: finding them is free), counted
        on the selection's device as a 0-d tensor that `DecodeStats` reads once per sample."""
        if selection is None:
            return 2 * layer.head_dim * layer.held_tokens()
        idx = selection.idx
        return 2 * layer.head_dim * distinct_rows(idx.reshape(idx.shape[0], -1), layer.physical_length())

    def observe(self, layer: "KVLayer", queries: torch.Tensor, step: Step) -> None:
        return None

    def observe_step(self, layer: "KVLayer", queries: torch.Tensor, step: Step) -> None:
        """`observe` of one decode step's query on the static layout (fixed shapes, state updated in place)."""
        raise NotImplementedError(f"{self.name} observes no decode step on the static layout")

    def keep(self, layer: "KVLayer", budget: int, step: Step) -> list[torch.Tensor] | None:
        return None

    def params(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class EvictionMethod(Method):
    """A method that permanently evicts, on the schedule its two fields describe (every eviction method
    accepts both, so any of them runs one-shot, block-wise or with decode-time eviction).

    `block_size`: None (one dense prefill of the compressed segment, evicted at its end) or M (the segment is
    fed in blocks of M tokens and every layer is cut back to its budget after each, so no head ever holds
    more than budget + M tokens). `decode_every`: evict after every N-th generated token (1: the cache stays
    at the budget while generating); None means 1 with `block_size` (KeyDiff: generation is the block loop
    with M = 1) and 0 without (the Ada-KV / kvpress framework: the cache grows while decoding).
    """

    family: ClassVar[str] = "eviction"
    evicts_every_turn: ClassVar[bool] = False  # True: later turns' inputs are compressed too (RocketKV)
    block_size: int | None = None
    decode_every: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"block_size must be a positive number of tokens or null, got {self.block_size!r}")
        if self.decode_every is not None and self.decode_every < 0:
            raise ValueError(f"decode_every must be a number of decode steps >= 0 or null, got {self.decode_every!r}")

    def schedule(self) -> Schedule:
        every = self.decode_every if self.decode_every is not None else int(self.block_size is not None)
        return Schedule(self.block_size, every, self.evicts_every_turn)




@dataclass
class SelectionMethod(Method):
    """A method that chooses, every decode step, the rows each query head attends (`select`): the dispatcher
    calls it on every layer that is not dense while the sample's plan has a selection budget (`plan`'s default
    sets it to the budget). It evicts too where its `schedule` says so (RocketKV: `EvictionMethod` as well), or
    moves rows off the device at one event (`OffloadMethod`).

    `static_selection`: `select`, its `step_traffic` and derived state are written for fixed shapes, so decode
    steps also run on the static layout (module doc); otherwise the method stays on the eager path."""

    family: ClassVar[str] = "selection"
    selects: ClassVar[bool] = True
    static_selection: ClassVar[bool] = False

    def static_decode_blocker(self) -> str | None:
        if self.host_work is None and not self.static_selection:
            return f"{self.name}'s decode-time selection is not written for fixed shapes"
        return super().static_decode_blocker()

    def select(
        self, layer: "KVLayer", q: torch.Tensor, view: HeadView, step: Step, scaling: float
    ) -> "torch.Tensor | Selection | None":
        raise NotImplementedError


@dataclass
class OffloadMethod(SelectionMethod):
    """A selection method whose one "eviction" event, at the compressed segment's end, moves (or factors) the
    prompt's rows off the device and indexes them, dropping nothing; every decode step then selects among them
    (MagicPIG, ShadowKV, RetrievalAttention, CTKVR). A budget at or above the sequence is full attention; below
    it the budget is the selection's and `plan_derived` adds the method's parameters. `offloaded`: the rows
    under `layer.derived["host"]` (a `HostSegment`), which a dense chunk appended later attends to too."""

    def schedule(self) -> Schedule:
        return Schedule(block_size=None, decode_every=0)

    def plan(self, budget: int, *, sequence_length: int, new_tokens: int, head_dim: int,
             num_layers: int | None = None) -> Plan:
        if budget >= sequence_length:
            return Plan.full_attention()
        return Plan(evict=budget, select=budget, derived=self.plan_derived(budget, sequence_length - new_tokens))

    def plan_derived(self, budget: int, prompt: int) -> dict[str, Any]:
        """The sample's parameters beside its budget (`Plan.derived`, recorded as its budget plan); `prompt`: the
        prompt's tokens."""
        return {}

    def offloaded(self, layer: "KVLayer") -> Any:
        return layer.derived.get("host")


@dataclass
class ScoredEviction(EvictionMethod):
    """An eviction method that ranks every stored token by one score (kvpress's `ScorerPress`): `keep` keeps,
    per head, the `budget` highest scores, the last `recent_tokens(budget)` tokens always kept. H2O, TOVA,
    KeyDiff and KeyL2Norm are nothing but their `score`."""

    def score(self, layer: "KVLayer", step: Step) -> torch.Tensor:
        """`[H, L]` fp32 scores of the layer's stored tokens, higher = keep."""
        raise NotImplementedError

    def recent_tokens(self, budget: int) -> int:
        return 0

    def keep(self, layer: "KVLayer", budget: int, step: Step) -> list[torch.Tensor] | None:
        if budget >= layer.physical_length():
            return None
        # a ragged layer (a rollback after per-head eviction drops more of one head's tokens than another's): each
        # head ranks its own tokens, never the padding `head_view` gives its shorter heads
        lengths = layer.lengths() if layer.is_ragged else None
        return keep_top(self.score(layer, step), budget, recent=self.recent_tokens(budget), lengths=lengths)

    def decode_eviction_scores(self, layer: "KVLayer", budget: int, step: Step) -> tuple[torch.Tensor, int]:
        """`keep`'s rule one token at a time: the `recent_tokens(budget)` newest tokens (by position) are kept,
        the lowest `score` of the others goes."""
        scores = self.score(layer, step)
        recent = min(self.recent_tokens(budget), budget)
        if recent:
            positions = layer.head_view().positions
            scores = scores.masked_fill(positions > positions.max() - recent, float("inf"))
        return scores, budget


def keep_top(scores: torch.Tensor, budget: int, recent: int = 0, lengths: list[int] | None = None) -> list[torch.Tensor]:
    """Per head, the sorted indices of the `budget` highest scores, the last `recent` entries always kept.

    scores: `[H, L]` (fp32). Used by the methods that rank every stored token by one score (H2O, TOVA, KeyDiff,
    KeyL2Norm, random): older tokens compete for `budget - recent` slots. On a uniform layer every head holds L
    tokens (column j is token j of each). On a ragged one `lengths` says how many each head holds (its first
    `lengths[h]` columns; the rest is `head_view`'s padding): each head keeps `min(budget, lengths[h])` of its own
    tokens, its last `recent` among them, and never a padding column.
    """
    if lengths is not None:
        return [keep_top(row[None, :n], budget, recent)[0] if n > budget else torch.arange(n, device=row.device)
                for row, n in zip(scores, lengths)]
    length = scores.shape[1]
    recent = min(recent, budget)
    tail = torch.arange(length - recent, length, device=scores.device)
    if budget == recent:
        return [tail] * scores.shape[0]
    top = scores[:, : length - recent].topk(budget - recent, dim=-1).indices.sort(dim=-1).values
    return [torch.cat([t, tail]) for t in top]
