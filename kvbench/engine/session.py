"""`Session`: one conversation on one cache (prefill, eviction events, decode, rollback), and decoding (greedy, or
each session's seeded sampling: `kvbench.engine.decoding`) and teacher-forced NLL of several sessions together."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from kvbench.attention.hooks import evict_layer
from kvbench.cache.batched import BatchedCache
from kvbench.cache.kvcache import KVBenchCache
from kvbench.core.contract import Plan, Step
from kvbench.core.devices import sync
from kvbench.core.stages import end_step
from kvbench.engine.compiled import CompiledDecoder, CompileFailed
from kvbench.engine.decoding import TokenChooser
from kvbench.engine.replay import LoopReplays
from kvbench.methods.base import Method
from kvbench.models import LoadedModel, cache_kwargs, model_head_dim, rotary_of

log = logging.getLogger(__name__)


class Session:
    """One conversation on one cache: prefill, append, decode, roll back, all with logical positions.

    The session owns the loop and fires the method's eviction events (its `schedule()`): the compressed
    segment is one forward evicted at its end, or blocks of `block_size` tokens each evicted after it; decode
    steps evict every `decode_every` steps. Teacher forcing follows the same schedule on a copy of the cache.
    Every forward gets a `Step` (`step_context`): what the attention function and the method's hooks need
    to know about it, handed over explicitly rather than set on the cache.

    With a `decoder` (`engine.compile`), a decode loop (`begin_decode` .. `end_decode`) runs on the static
    layout: the cache enters it at the loop's first step and every step is the compiled graph. A method that
    evicts while decoding takes the loop's first step eagerly: that step may drop several tokens per head (a
    question appended uncompressed), every later one drops at most one, which is what the static layout does.
    """

    def __init__(
        self,
        lm: LoadedModel,
        method: Method | None,
        budget: int | Plan | None,
        cache: KVBenchCache | None = None,
        sequence_length: int | None = None,
        generator: torch.Generator | None = None,
    ):
        """`budget`: the method's `Plan` for this sample, or a token budget to plan from (`sequence_length`
        is the prompt plus the tokens to generate, which selection methods derive their parameters from).
        A given `cache` (a clone) comes with no method state tracked; the caller says what to track.
        `generator`: the sample's (`engine.sample.sample_generator`), which every `Step` hands the method; a
        session of no sample draws from one seeded with 0."""
        self.lm = lm
        self.method = method
        self.schedule = method.schedule() if method is not None else None
        if isinstance(budget, int) and method is not None:
            budget = method.plan(budget, sequence_length=sequence_length or lm.max_positions, new_tokens=0,
                                 head_dim=model_head_dim(lm), num_layers=lm.model.config.num_hidden_layers)
        self.plan: Plan | None = budget if method is not None else None
        self.query_window = 0  # queries each layer keeps for the method's scores
        self.observe = False  # the method observes every attention call (H2O)
        self.measure_recall = False  # selection methods: top-k attention-mass recall of every decode step
        self.shared: dict[str, Any] = {}  # method state shared by the cache's layers (OmniKV)
        self.generator = generator if generator is not None else torch.Generator().manual_seed(0)
        self.rotary = rotary_of(lm)
        self.prefill_attention = None  # the first forward's attention when not dense (`EngineConfig.prefill_attention`)
        self.cache = cache if cache is not None else KVBenchCache(lm.model.config.num_hidden_layers)
        if cache is None:
            self.track_method_state(self.schedule is not None)
        self.position = self.cache.get_seq_length()
        self.decode_steps = 0
        # the compiled decode path (kvbench.engine.compiled): None decodes eagerly, `decode_path_reason` says why
        # when compiling was asked for
        self.decoder: CompiledDecoder | None = None
        self.decode_path_reason: str | None = None
        self.steps_taken = 0  # decode steps (`step`) this session (and its teacher-forcing forks) took
        self.static_steps = 0  # of which ran compiled
        self.static_flash_decode = False  # the static layout's dense attention was the split-K kernel (CUDA)
        self.compile_s = 0.0  # seconds of the calls that compiled (not decode steps' time)
        self.compiles = 0
        self.static_loop: LoopReplays | None = None  # the current static decode loop's replays (compiled path)
        self.replayed_steps = 0  # compiled steps that replayed their graph without dynamo (kvbench.engine.replay)
        self.last_step_compiled = False
        self._static_left = 0  # steps the current decode loop may still take on the static layout
        self._eager_first = False
        # the fewest rows the dense layers of an eager decode step multiply (`step_batch` pads to it): a row then
        # takes the same products alone as in a batch (`EngineConfig.row_block`; 1: a lone row is stock's M = 1)
        self.row_block = 1
        self.rows_shared = 0  # the most rows (padding aside) of a decode forward this session took part in

    def step_context(self, evict: bool = False) -> Step:
        return Step(self.cache, self.method, self.plan, evict=evict, observe=self.observe,
                    query_window=self.query_window, measure_recall=self.measure_recall, shared=self.shared,
                    rotary=self.rotary, generator=self.generator, prefill_attention=self.prefill_attention)

    def track_method_state(self, live: bool) -> None:
        """Keep (and feed) the method's state only while an eviction event can still happen; free it after."""
        method = self.method if live else None
        self.observe = method is not None and method.observes
        self.query_window = method.obs_window if method is not None else 0
        self.cache.trim_method_state(self.query_window, drop_token_state=not live)

    def end_segment(self) -> None:
        """The compressed segment is done: the method's state lives on only if later events still evict, and
        its derived state is built over what the layers now hold."""
        schedule = self.schedule
        self.track_method_state(bool(schedule and (schedule.decode_every or schedule.every_turn)))
        if self.method is not None:
            step = self.step_context()
            for layer in self.cache.layers:
                if not layer.derived and layer.keys is not None and not self.method.is_dense_layer(layer.layer_idx):
                    layer.derived = self.method.build_derived(layer, step)

    def evict_deferred(self) -> None:
        """Eviction at the end of a dense segment run earlier (a shared prefill snapshot): the method's hook
        on every layer, from the queries the layers kept, exactly as it would have run inline."""
        step = self.step_context(evict=True)
        for layer in self.cache.layers:
            evict_layer(layer, step)
        self.end_segment()

    @torch.inference_mode()
    def forward(self, ids: list[int], logits_to_keep: int = 1, evict: bool = False) -> torch.Tensor:
        """One forward pass over `ids`; with `evict`, every layer runs the method's eviction right after its
        attention (an eviction event)."""
        device = self.lm.device
        out = self.lm.model(
            input_ids=torch.tensor([ids], device=device),
            position_ids=torch.arange(self.position, self.position + len(ids), device=device)[None],
            **cache_kwargs(self.lm.model, self.cache),
            use_cache=True,
            logits_to_keep=logits_to_keep,
            kvbench_steps=[self.step_context(evict)],
        )
        self.position += len(ids)
        return out.logits[0, -logits_to_keep:].float()

    def step(self, token: int) -> torch.Tensor:
        """One decode step; an eviction event every `decode_every` steps of the method's schedule. Compiled on
        the static layout inside a decode loop with a decoder, eager otherwise."""
        evict = self.next_step_evicts()
        self.last_step_compiled = False
        self.steps_taken += 1
        if self._static_left > 0:
            self._static_left -= 1
            if self._eager_first:
                self._eager_first = False
            else:
                return self._static_step(token, evict)
        return _rows_forward([self], [token], [evict])[0]

    @property
    def steps_alone(self) -> bool:
        """Whether this session's decode steps run alone: a compiled decode loop is one graph per session."""
        return self._static_left > 0

    @property
    def decode_path(self) -> str | None:
        """`compiled` if any decode step (teacher forcing included) ran compiled, `eager` if they all ran eagerly,
        None if no decode step ran."""
        return "compiled" if self.static_steps else "eager" if self.steps_taken else None

    def begin_decode(self, steps: int) -> None:
        """Before a loop of up to `steps` decode steps: room for them (the static layout's capacity, or the eager
        layout's reserved rows, so that no step copies a layer)."""
        failure = self.decoder.failure(self.method) if self.decoder is not None else None
        if self.decoder is not None and failure is None and steps > 0:
            self._static_left = steps
            self._eager_first = bool(self.schedule is not None and self.schedule.decode_every)
        else:
            self.decode_path_reason = failure or self.decode_path_reason
            self.cache.reserve(steps)

    def end_decode(self) -> None:
        """After a decode loop: the cache back in the eager layout, its device counters read once."""
        self._static_left, self._eager_first = 0, False
        self._end_static_loop()

    def _end_static_loop(self) -> None:
        """The cache back in the eager layout; the loop's replays (and the tensors they hold) dropped."""
        if self.static_loop is not None:
            self.replayed_steps += self.static_loop.replayed
            self.static_loop = None
        if self.cache.is_static:
            self.cache.make_dynamic()

    def _static_step(self, token: int, evict: bool) -> torch.Tensor:
        if not self.cache.is_static:
            method = self.method
            self.cache.make_static(self._static_left + 1, self.query_window, self.lm.model.config.num_attention_heads,
                                   ragged=method is not None and method.ragged_layers,
                                   tight=method is not None and method.repeats_kv)  # reads its whole capacity
            self.static_flash_decode = self.cache.layers[0].static.flash_decode
            self.static_loop = self.decoder.new_loop()
        try:
            logits, compile_s = self.decoder.step(self, token, self.step_context(evict))
        except CompileFailed as exc:  # nothing ran: the same step eagerly, and the point decodes eagerly from now
            self.decode_path_reason = f"compile failed: {exc}"
            self.decoder.record_failure(self.method, self.decode_path_reason)
            log.warning("kvbench: the compiled decode step of %s failed to compile (%s); decoding eagerly",
                        getattr(self.method, "name", "full"), exc)
            self._static_left = 0
            self._end_static_loop()
            return _rows_forward([self], [token], [evict])[0]
        self.cache.static_advance(1)
        self.position += 1
        self.static_steps += 1
        if compile_s:
            self.compile_s += compile_s
            self.compiles += 1
            self.last_step_compiled = True
        return logits

    def next_step_evicts(self) -> bool:
        """Count a decode step and say whether the method's schedule evicts at it."""
        self.decode_steps += 1
        every = self.schedule.decode_every if self.schedule is not None else 0
        return bool(every) and self.decode_steps % every == 0

    def fork(self) -> "Session":
        """A session on a copy of this one's cache (shared storage until it diverges), at the same step."""
        fork = Session(self.lm, self.method, self.plan, self.cache.clone())
        fork.decoder, fork.row_block = self.decoder, self.row_block
        fork.query_window, fork.observe, fork.measure_recall = self.query_window, self.observe, self.measure_recall
        fork.shared = dict(self.shared)
        fork.position, fork.decode_steps = self.position, self.decode_steps
        # the fork draws from a copy: teacher forcing (engine.nll) leaves the draws of the decode it precedes alone
        fork.generator = torch.Generator().set_state(self.generator.get_state())
        return fork

    def prefill(self, ids: list[int], compress: bool) -> tuple[torch.Tensor, float]:
        """Prefill a chunk. With `compress` it is the segment to compress: one forward evicted at its end, or
        the method's blocks, each evicted after its forward (the cache never holds more than budget + block).
        A chunk appended later (the question, a turn) goes token by token through the decode path when the
        method retrieves at every step (`steps_through_chunks`)."""
        block = self.schedule.block_size if compress and self.schedule is not None else None
        stepwise = self.method is not None and self.method.steps_through_chunks and self.position > 0
        if stepwise:  # an appended chunk goes token by token through the method's decode path (CTKVR)
            block = 1
        chunks = [ids[i:i + block] for i in range(0, len(ids), block)] if block else [ids]
        sync(self.lm.device)
        start = time.perf_counter()
        for i, chunk in enumerate(chunks):
            # block-wise: an eviction event after every block; stepwise: one at the end of the chunk
            logits = self.forward(chunk, evict=compress and (not stepwise or i == len(chunks) - 1))[-1]
        sync(self.lm.device)
        if compress:
            self.end_segment()
        return logits, time.perf_counter() - start

    def decode(
        self,
        logits: torch.Tensor,
        max_new_tokens: int,
        stop_ids: set[int],
        stop_strings: list[str],
        min_new_tokens: int = 0,
        chooser: TokenChooser | None = None,
    ) -> tuple[list[int], list[float], str]:
        """Decoding (`decode_batch` with this session alone; greedy without a `chooser`): the new tokens, the wall
        time of each decode forward, and why it stopped."""
        return decode_batch([self], [logits], [max_new_tokens], stop_ids, [stop_strings], [min_new_tokens],
                            choosers=None if chooser is None else [chooser])[0]

    def teacher_forced_nll(self, logits: torch.Tensor, target: list[int]) -> float:
        """Mean NLL of `target` continuing the current state (`teacher_forced_nll_batch` alone)."""
        return teacher_forced_nll_batch([self], [logits], [target])[0]

    def rollback(self, logical_length: int) -> None:
        self.cache.truncate(logical_length)
        self.position = logical_length


def forward_groups(sessions: list[Session], rows: list[int], max_rows: int) -> list[list[int]]:
    """The decode forwards that step `rows` (indices into `sessions`): a session in a compiled decode loop alone
    (one graph per session), the others in forwards of at most `max_rows` rows."""
    alone = [[r] for r in rows if sessions[r].steps_alone]
    shared = [r for r in rows if not sessions[r].steps_alone]
    return alone + [shared[first:first + max_rows] for first in range(0, len(shared), max(1, max_rows))]


def step_batch(sessions: list[Session], tokens: list[int], max_rows: int = 1) -> list[torch.Tensor]:
    """One decode step of several sessions, in the forwards `forward_groups` makes of them: each shared forward a
    `BatchedCache` (the dense layers read the weights once for all rows, each row attends over its own cache and
    runs its own hooks), each compiled session its own graph."""
    out: list[torch.Tensor | None] = [None] * len(sessions)
    for group in forward_groups(sessions, list(range(len(sessions))), max_rows):
        for r, logits in zip(group, _step_group([sessions[r] for r in group], [tokens[r] for r in group])):
            out[r] = logits
    return out  # type: ignore[return-value]


def _step_group(sessions: list[Session], tokens: list[int]) -> list[torch.Tensor]:
    if len(sessions) == 1:
        return [sessions[0].step(tokens[0])]
    evicts = [s.next_step_evicts() for s in sessions]
    for session in sessions:
        session.steps_taken += 1
        session.last_step_compiled = False
    return _rows_forward(sessions, tokens, evicts)


@torch.inference_mode()
def _rows_forward(sessions: list[Session], tokens: list[int], evicts: list[bool]) -> list[torch.Tensor]:
    """One eager decode forward of `sessions`, padded with rows that hold no cache to a multiple of the sessions'
    row block: every dense product multiplies whole blocks of rows, whether a session decodes alone or in a batch,
    which (where the machine's kernels are batch-invariant on whole blocks: `kvbench.engine.invariance`) gives a
    row the same bits alone and batched. A block of 1 with one session is the plain forward."""
    lm = sessions[0].lm
    padding = -len(sessions) % max(s.row_block for s in sessions)
    for session in sessions:
        session.rows_shared = max(session.rows_shared, len(sessions))
    if len(sessions) == 1 and not padding:
        return [sessions[0].forward(tokens, evict=evicts[0])[-1]]
    out = lm.model(
        input_ids=torch.tensor(tokens + [tokens[0]] * padding, device=lm.device)[:, None],
        position_ids=torch.tensor([s.position for s in sessions] + [0] * padding, device=lm.device)[:, None],
        **cache_kwargs(lm.model, BatchedCache([s.cache for s in sessions] + [None] * padding)),
        use_cache=True,
        logits_to_keep=1,
        kvbench_steps=[s.step_context(e) for s, e in zip(sessions, evicts)] + [None] * padding,
    )
    for session in sessions:
        session.position += 1
    return list(out.logits[:len(sessions), -1].float())


def decode_batch(
    sessions: list[Session],
    logits: list[torch.Tensor],
    max_new_tokens: list[int],
    stop_ids: set[int],
    stop_strings: list[list[str]],
    min_new_tokens: list[int],
    max_rows: int = 1,
    choosers: list[TokenChooser] | None = None,
) -> list[tuple[list[int], list[float], str]]:
    """Decoding of several sessions together, each with its own limits, stopping and token choice (`choosers`:
    one per session, its greedy argmax or its own seeded sampling; None: all greedy), `max_rows` per forward. Per
    session: the new tokens, its share of the wall time of each decode forward it took part in (its own time
    when it decodes alone), and why it stopped.

    Before `min_new_tokens` tokens, EOS is masked and stop strings are not checked (LongBench's samsum
    protocol, which would otherwise stop on an immediate newline). A finished session leaves the batch.
    """
    n = len(sessions)
    tokens: list[list[int]] = [[] for _ in range(n)]
    step_times: list[list[float]] = [[] for _ in range(n)]
    reasons = ["max_new_tokens"] * n
    tokenizer = sessions[0].lm.tokenizer
    device = sessions[0].lm.device
    for session, limit in zip(sessions, max_new_tokens):
        session.begin_decode(limit - 1)  # the steps below then append without copying a layer
    blocked = torch.tensor(sorted(stop_ids), device=logits[0].device, dtype=torch.long)
    current = list(logits)
    active = [r for r in range(n) if max_new_tokens[r] > 0]
    while active:
        stepping = []
        for r in active:
            row_logits = current[r]
            if len(tokens[r]) < min_new_tokens[r] and len(blocked):
                row_logits = row_logits.index_fill(0, blocked, float("-inf"))
            token = int(torch.argmax(row_logits)) if choosers is None else choosers[r](row_logits)
            tokens[r].append(token)
            early = len(tokens[r]) <= min_new_tokens[r]
            if token in stop_ids:
                reasons[r] = "eos"
            elif stop_strings[r] and not early and any(s in tokenizer.decode(tokens[r]) for s in stop_strings[r]):
                reasons[r] = "stop_string"
            elif len(tokens[r]) < max_new_tokens[r]:
                stepping.append(r)
        active = stepping
        if not active:
            break
        for rows in forward_groups(sessions, active, max_rows):  # each forward timed alone, shared by its rows
            sync(device)
            start = time.perf_counter()
            new_logits = _step_group([sessions[r] for r in rows], [tokens[r][-1] for r in rows])
            sync(device)
            share = (time.perf_counter() - start) / len(rows)
            for r, row_logits in zip(rows, new_logits):
                current[r] = row_logits
                if not sessions[r].last_step_compiled:  # a call that compiled is compile time, not a step's
                    step_times[r].append(share)
            end_step()  # a stage-timed profile's step ends here (kvbench.core.stages; a no-op otherwise)
    for session in sessions:
        session.end_decode()
    return [(tokens[r], step_times[r], reasons[r]) for r in range(n)]


def teacher_forced_nll_batch(sessions: list[Session], logits: list[torch.Tensor], targets: list[list[int]],
                             max_rows: int = 1) -> list[float]:
    """Mean NLL of each session's `target` continuing its current state, one decode step per token on a
    copy of its cache, the sessions stepping together.

    The copy shares storage until it diverges and the steps go through the same decode path (selection and
    decode-time eviction included), so this measures the compressed cache the method would really decode
    with. NaN for an empty target.
    """
    forks = [session.fork() for session in sessions]
    for fork, target in zip(forks, targets):
        fork.begin_decode(len(target) - 1)
    totals = [0.0] * len(sessions)
    current = list(logits)
    for i in range(max((len(t) for t in targets), default=0)):
        for r, target in enumerate(targets):
            if i < len(target):
                totals[r] -= float(torch.log_softmax(current[r], dim=-1)[target[i]])
        rows = [r for r, target in enumerate(targets) if i + 1 < len(target)]
        if rows:
            for r, row_logits in zip(rows, step_batch([forks[r] for r in rows], [targets[r][i] for r in rows], max_rows)):
                current[r] = row_logits
    for session, fork in zip(sessions, forks):  # the forks' steps are the row's decode steps too
        session.compile_s, session.compiles = session.compile_s + fork.compile_s, session.compiles + fork.compiles
        session.static_steps, session.steps_taken = session.static_steps + fork.static_steps, \
            session.steps_taken + fork.steps_taken
        session.replayed_steps += fork.replayed_steps + (fork.static_loop.replayed if fork.static_loop else 0)
        session.rows_shared = max(session.rows_shared, fork.rows_shared)
    return [total / len(target) if target else float("nan") for total, target in zip(totals, targets)]
