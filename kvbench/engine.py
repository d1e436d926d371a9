"""Running one sample: build the prompt, prefill, compress, decode greedily, score.

The data flow for a single-turn sample, question-aware (`compress_question=true`):

    [context + question + answer prefix] --prefill--> compress (method's prefill hook) --> greedy decode

and question-agnostic (`compress_question=false`, the KVPress protocol Ada-KV follows):

    [context] --prefill--> compress --> [question + answer prefix] appended uncompressed --> greedy decode

Later turns of a multi-turn sample roll the cache back to the end of the previous prompt (golden-context
mode: the gold answer, not the model's reply, becomes the history), append the next chunk uncompressed and
decode again. Positions are explicit logical positions, so RoPE stays right whatever was evicted.

Eviction after a dense prefill does not change the prefill itself, so with `reuse_prefill` one dense prefill
per prompt serves every method and budget of a sweep (`PrefillSnapshots`); eviction then runs from the
captured observation-window queries through exactly the same hook. Turn it off to measure memory peaks.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from kvbench.cache import BatchedCache, KVBenchCache
from kvbench.errors import KVBenchError
from kvbench.methods.base import Method, Plan
from kvbench.models import LoadedModel
from kvbench.profiler import PhaseProfiler
from kvbench.tasks.base import Sample
from kvbench.tasks.scoring import score as score_prediction

log = logging.getLogger(__name__)

_SPLIT = "\ue000kvbench-split\ue000"  # a private-use marker: chat templates leave it alone


@dataclass
class EngineConfig:
    compress_question: bool = True
    reuse_prefill: bool = True
    snapshot_window: int = 128  # observation queries kept per layer in a reusable prefill snapshot
    snapshot_cache_mb: int = 2048
    nll: bool = True
    chat_template: bool = True  # apply the model's chat template where the sample asks for it
    system_prompt: str | None = None
    topk_recall: bool = True  # selection methods: measure top-k attention-mass recall at every decode step
    sample_batch: int = 1  # samples of one point run together (run_group)
    # rows of a group decoded in one forward. 1: each row alone, records bitwise those of a lone run. More:
    # faster, but CPU/GPU kernels round a batched row differently, so NLLs and (at near-ties) predictions
    # drift from a lone run's (bf16 SmolLM2: 3 of 104 greedy answers, NLLs by up to ~5%)
    batch_rows: int = 1


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
    if isinstance(budget, float) and budget < 1:
        return max(1, round(budget * length))
    if isinstance(budget, float) and not budget.is_integer():
        raise KVBenchError(f"budget {budget} is neither a token count nor a ratio in (0, 1)")
    return int(budget)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class PromptBuilder:
    """Token ids of each prompt part, with the model's chat template when the sample asks for it.

    Both modes see the same token sequence: the context part and the question part are tokenized
    separately, so question-agnostic and question-aware runs differ only in where compression happens.
    """

    def __init__(self, tokenizer: Any, use_chat_template: bool = True, system_prompt: str | None = None):
        self.tokenizer = tokenizer
        self.use_chat_template = use_chat_template and getattr(tokenizer, "chat_template", None) is not None
        self.system_prompt = system_prompt

    def _templated(self, sample_chat: bool) -> bool:
        return self.use_chat_template and sample_chat

    def _render(self, messages: list[dict[str, str]]) -> str:
        if self.system_prompt is not None:
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def _ids(self, text: str, first: bool) -> list[int]:
        return self.tokenizer(text, add_special_tokens=first, return_attention_mask=False)["input_ids"]

    def split_texts(self, context: str, question: str, answer_prefix: str, chat: bool) -> tuple[str, str]:
        if not self._templated(chat):
            return context, question + answer_prefix
        text = self._render([{"role": "user", "content": context + _SPLIT + question}]) + answer_prefix
        head, tail = text.split(_SPLIT)
        return head, tail

    def first_turn(self, sample: Sample) -> tuple[list[int], list[int]]:
        if sample.token_prompt is not None:
            return self.token_prompt_ids(sample.token_prompt), []
        turn = sample.turns[0]
        head, tail = self.split_texts(sample.context, turn.question, turn.answer_prefix, sample.chat_template)
        templated = self._templated(sample.chat_template)
        return self._ids(head, first=not templated), self._ids(tail, first=False)

    def token_prompt_ids(self, recipe: dict[str, Any]) -> list[int]:
        """Token ids from a synthetic recipe: `length` ordinary tokens (no special ones), uniformly random or
        one token repeated, drawn with the recipe's seed."""
        special = set(self.tokenizer.all_special_ids)
        ordinary = torch.tensor([i for i in range(len(self.tokenizer)) if i not in special])
        gen = torch.Generator().manual_seed(int(recipe["seed"]))
        count = recipe["length"] if recipe["kind"] == "random" else 1
        ids = ordinary[torch.randint(len(ordinary), (count,), generator=gen)].tolist()
        return ids if recipe["kind"] == "random" else ids * recipe["length"]

    def measure(self, context: str, question: str = "", answer_prefix: str = "", chat_template: bool = True) -> int:
        head, tail = self.split_texts(context, question, answer_prefix, chat_template)
        return len(self._ids(head, first=not self._templated(chat_template))) + len(self._ids(tail, first=False))

    def history_text(self, sample: Sample, upto: int) -> str:
        """The rendered prompt through turn `upto` (0-based), gold answers standing in for earlier replies.

        The cache is rolled back to the end of turn t's prompt (its answer prefix included) before turn t+1,
        so the gold answer continues that prefix exactly as a model reply would have.
        """
        turns = sample.turns
        if not self._templated(sample.chat_template):
            text = sample.context + turns[0].question + turns[0].answer_prefix
            for t in range(1, upto + 1):
                text += history_answer(sample, t - 1) + "\n\n" + turns[t].question + turns[t].answer_prefix
            return text
        messages = [{"role": "user", "content": sample.context + turns[0].question}]
        for t in range(1, upto + 1):
            prev = turns[t - 1]
            messages.append({"role": "assistant", "content": prev.answer_prefix + history_answer(sample, t - 1)})
            messages.append({"role": "user", "content": turns[t].question})
        return self._render(messages) + turns[upto].answer_prefix

    def next_turn(self, sample: Sample, t: int) -> list[int]:
        before, after = self.history_text(sample, t - 1), self.history_text(sample, t)
        if not after.startswith(before):
            raise KVBenchError("the chat template renders earlier turns differently once a turn is added")
        return self._ids(after[len(before):], first=False)

    def request(self, sample: Sample, t: int) -> list[int]:
        """Turn t as an independent request on the cached context (multi-request mode)."""
        turn = sample.turns[t]
        _, tail = self.split_texts("", turn.question, turn.answer_prefix, sample.chat_template)
        return self._ids(tail, first=False)


def continuation(answer: str, answer_prefix: str) -> str:
    """`answer` as the model would continue `answer_prefix`: a space after a word."""
    if answer_prefix and not answer_prefix[-1].isspace() and not answer[:1].isspace():
        return " " + answer
    return answer


def gold_continuation(turn: Any) -> str:
    """The first gold answer continuing the turn's answer prefix (the teacher-forcing target)."""
    return continuation(turn.answers[0] if turn.answers else "", turn.answer_prefix)


def history_answer(sample: Sample, t: int) -> str:
    """What stands in for the model's reply to turn t in the next turn's history (golden context).

    A task may give the exact string its reference inserts (`meta["golden_answers"]`, e.g. SCBench's
    `str(answer)`); otherwise the first gold answer.
    """
    golden = sample.meta.get("golden_answers")
    if golden is not None:
        return continuation(golden[t], sample.turns[t].answer_prefix)
    return gold_continuation(sample.turns[t])


class PrefillSnapshots:
    """LRU of dense prefills (per-layer K/V, captured window queries, last logits), bounded in bytes."""

    def __init__(self, limit_mb: int):
        self.limit = limit_mb * 2**20
        self.entries: OrderedDict[tuple, tuple[KVBenchCache, torch.Tensor, float, int]] = OrderedDict()

    def get(self, key: tuple) -> tuple[KVBenchCache, torch.Tensor, float] | None:
        if key not in self.entries:
            return None
        self.entries.move_to_end(key)
        cache, logits, seconds, _ = self.entries[key]
        return cache, logits, seconds

    def put(self, key: tuple, cache: KVBenchCache, logits: torch.Tensor, seconds: float) -> None:
        size = cache.nbytes()
        if size > self.limit:
            return
        self.entries[key] = (cache, logits, seconds, size)
        while sum(e[3] for e in self.entries.values()) > self.limit:
            self.entries.popitem(last=False)


_SNAPSHOTS: PrefillSnapshots | None = None


def snapshots(limit_mb: int) -> PrefillSnapshots:
    global _SNAPSHOTS
    if _SNAPSHOTS is None or _SNAPSHOTS.limit != limit_mb * 2**20:
        _SNAPSHOTS = PrefillSnapshots(limit_mb)
    return _SNAPSHOTS


class Session:
    """One conversation on one cache: prefill, append, decode, roll back, all with logical positions.

    The session owns the loop and fires the method's eviction events (its `schedule()`): the compressed
    segment is one forward evicted at its end, or blocks of `block_size` tokens each evicted after it; decode
    steps evict every `decode_every` steps. Teacher forcing follows the same schedule on a copy of the cache.
    """

    def __init__(
        self,
        lm: LoadedModel,
        method: Method | None,
        budget: int | Plan | None,
        cache: KVBenchCache | None = None,
        sequence_length: int | None = None,
    ):
        """`budget`: the method's `Plan` for this sample, or a token budget to plan from (`sequence_length`
        is the prompt plus the tokens to generate, which selection methods derive their parameters from)."""
        self.lm = lm
        self.method = method
        self.schedule = method.schedule() if method is not None else None
        if isinstance(budget, int) and method is not None:
            budget = method.plan(budget, sequence_length=sequence_length or lm.max_positions, new_tokens=0,
                                 head_dim=_head_dim(lm))
        n_layers = lm.model.config.num_hidden_layers
        self.cache = cache if cache is not None else KVBenchCache(n_layers, method, budget)
        self.position = self.cache.get_seq_length()
        self.decode_steps = 0

    @torch.inference_mode()
    def forward(self, ids: list[int], logits_to_keep: int = 1, evict: bool = False) -> torch.Tensor:
        """One forward pass over `ids`; with `evict`, every layer runs the method's eviction right after its
        attention (an eviction event)."""
        device = self.lm.device
        input_ids = torch.tensor([ids], device=device)
        positions = torch.arange(self.position, self.position + len(ids), device=device)[None]
        self.cache.evict_now = evict
        try:
            out = self.lm.model(
                input_ids=input_ids,
                position_ids=positions,
                past_key_values=self.cache,
                use_cache=True,
                logits_to_keep=logits_to_keep,
            )
        finally:
            self.cache.evict_now = False
        self.position += len(ids)
        return out.logits[0, -logits_to_keep:].float()

    def step(self, token: int) -> torch.Tensor:
        """One decode step; an eviction event every `decode_every` steps of the method's schedule."""
        return self.forward([token], evict=self.next_step_evicts())[-1]

    def next_step_evicts(self) -> bool:
        """Count a decode step and say whether the method's schedule evicts at it."""
        self.decode_steps += 1
        every = self.schedule.decode_every if self.schedule is not None else 0
        return bool(every) and self.decode_steps % every == 0

    def twin(self) -> "Session":
        """A session on a copy of this one's cache (shared storage until it diverges), at the same step."""
        twin = Session(self.lm, self.method, self.cache.plan, self.cache.clone())
        twin.position, twin.decode_steps = self.position, self.decode_steps
        return twin

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
        _sync(self.lm.device)
        start = time.perf_counter()
        for i, chunk in enumerate(chunks):
            # block-wise: an eviction event after every block; stepwise: one at the end of the chunk
            logits = self.forward(chunk, evict=compress and (not stepwise or i == len(chunks) - 1))[-1]
        _sync(self.lm.device)
        if compress:
            self.cache.end_segment()
        return logits, time.perf_counter() - start

    def decode(
        self,
        logits: torch.Tensor,
        max_new_tokens: int,
        stop_ids: set[int],
        stop_strings: list[str],
        min_new_tokens: int = 0,
    ) -> tuple[list[int], list[float], str]:
        """Greedy decoding (`decode_batch` with this session alone): the new tokens, the wall time of each
        decode forward, and why it stopped."""
        return decode_batch([self], [logits], [max_new_tokens], stop_ids, [stop_strings], [min_new_tokens])[0]

    def teacher_forced_nll(self, logits: torch.Tensor, target: list[int]) -> float:
        """Mean NLL of `target` continuing the current state (`teacher_forced_nll_batch` alone)."""
        return teacher_forced_nll_batch([self], [logits], [target])[0]

    def rollback(self, logical_length: int) -> None:
        self.cache.truncate(logical_length)
        self.position = logical_length


@torch.inference_mode()
def step_batch(sessions: list[Session], tokens: list[int], max_rows: int = 1) -> list[torch.Tensor]:
    """One decode step of several sessions in one forward (a `BatchedCache`: the dense layers read the
    weights once for all rows, each row attends over its own cache and runs its own hooks), in batches of at
    most `max_rows` (1: each row alone, bitwise a lone run). One session takes `Session.step`, so an
    ungrouped run is exactly what it always was."""
    if len(sessions) == 1:
        return [sessions[0].step(tokens[0])]
    lm = sessions[0].lm
    if len(sessions) > max_rows:
        return [logits for start in range(0, len(sessions), max_rows)
                for logits in step_batch(sessions[start:start + max_rows], tokens[start:start + max_rows], max_rows)]
    for session in sessions:
        session.cache.evict_now = session.next_step_evicts()
    try:
        out = lm.model(
            input_ids=torch.tensor(tokens, device=lm.device)[:, None],
            position_ids=torch.tensor([s.position for s in sessions], device=lm.device)[:, None],
            past_key_values=BatchedCache([s.cache for s in sessions]),
            use_cache=True,
            logits_to_keep=1,
        )
    finally:
        for session in sessions:
            session.cache.evict_now = False
    for session in sessions:
        session.position += 1
    return list(out.logits[:, -1].float())


def decode_batch(
    sessions: list[Session],
    logits: list[torch.Tensor],
    max_new_tokens: list[int],
    stop_ids: set[int],
    stop_strings: list[list[str]],
    min_new_tokens: list[int],
    max_rows: int = 1,
) -> list[tuple[list[int], list[float], str]]:
    """Greedy decoding of several sessions together, each with its own limits and stopping, `max_rows` per
    forward. Per session: the new tokens, its share of the wall time of each decode forward it took part in
    (its own time when it decodes alone), and why it stopped.

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
        session.cache.reserve(limit - 1)  # the steps below then append without copying a layer
    blocked = torch.tensor(sorted(stop_ids), device=logits[0].device, dtype=torch.long)
    current = list(logits)
    active = [r for r in range(n) if max_new_tokens[r] > 0]
    while active:
        stepping = []
        for r in active:
            row_logits = current[r]
            if len(tokens[r]) < min_new_tokens[r] and len(blocked):
                row_logits = row_logits.index_fill(0, blocked, float("-inf"))
            token = int(torch.argmax(row_logits))
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
        for first in range(0, len(active), max_rows):  # each forward timed alone, its time shared by its rows
            rows = active[first:first + max_rows]
            _sync(device)
            start = time.perf_counter()
            new_logits = step_batch([sessions[r] for r in rows], [tokens[r][-1] for r in rows], max_rows)
            _sync(device)
            share = (time.perf_counter() - start) / len(rows)
            for r, row_logits in zip(rows, new_logits):
                current[r] = row_logits
                step_times[r].append(share)
    return [(tokens[r], step_times[r], reasons[r]) for r in range(n)]


def teacher_forced_nll_batch(sessions: list[Session], logits: list[torch.Tensor], targets: list[list[int]],
                             max_rows: int = 1) -> list[float]:
    """Mean NLL of each session's `target` continuing its current state, one decode step per token on a
    copy of its cache, the sessions stepping together.

    The copy shares storage until it diverges and the steps go through the same decode path (selection and
    decode-time eviction included), so this measures the compressed cache the method would really decode
    with. NaN for an empty target.
    """
    twins = [session.twin() for session in sessions]
    for twin, target in zip(twins, targets):
        twin.cache.reserve(len(target) - 1)
    totals = [0.0] * len(sessions)
    current = list(logits)
    for i in range(max((len(t) for t in targets), default=0)):
        for r, target in enumerate(targets):
            if i < len(target):
                totals[r] -= float(torch.log_softmax(current[r], dim=-1)[target[i]])
        rows = [r for r, target in enumerate(targets) if i + 1 < len(target)]
        if rows:
            for r, row_logits in zip(rows, step_batch([twins[r] for r in rows], [targets[r][i] for r in rows], max_rows)):
                current[r] = row_logits
    return [total / len(target) if target else float("nan") for total, target in zip(totals, targets)]


def _head_dim(lm: LoadedModel) -> int:
    config = lm.model.config
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def stop_token_ids(lm: LoadedModel) -> set[int]:
    ids: set[int] = set()
    for source in (lm.tokenizer.eos_token_id, getattr(lm.model.generation_config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(int(i) for i in source)
    return ids


def _truncate_middle(ids: list[int], keep: int) -> list[int]:
    half = keep // 2
    return ids[:half] + ids[len(ids) - (keep - half):]


def fit_to_model(lm: LoadedModel, sample: Sample, ctx_ids: list[int], q_ids: list[int]) -> list[int]:
    """Enforce the prompt limits: middle-truncate the context (LongBench, SCBench) or refuse.

    The limit is the model's positions minus the tokens to generate, and the task's own cap on the first
    prompt (`meta["prompt_token_limit"]`, e.g. SCBench's max_seq_length minus its reserve) when it has one.
    """
    new_tokens = sum(t.max_new_tokens for t in sample.turns)
    limit = lm.max_positions - new_tokens
    if sample.meta.get("prompt_token_limit"):
        limit = min(limit, int(sample.meta["prompt_token_limit"]))
    prompt = len(ctx_ids) + len(q_ids)
    if prompt <= limit:
        return ctx_ids
    if sample.truncation == "middle" and limit > len(q_ids):
        return _truncate_middle(ctx_ids, limit - len(q_ids))
    raise KVBenchError(
        f"sample {sample.id}: {prompt} prompt tokens + {new_tokens} new tokens exceed the limit of "
        f"{lm.max_positions} positions of {lm.name}; lower task.seq_len"
    )


def _score_turn(turn: Any, prediction: str, extra: list[str]) -> dict[str, Any]:
    if turn.metric == "none":  # synthetic efficiency inputs: nothing to score
        return {"score": None}
    scores = {"score": score_prediction(turn.metric, prediction, turn.answers, **turn.metric_args)}
    if extra:
        scores["extra_scores"] = {m: score_prediction(m, prediction, turn.answers) for m in extra}
    return scores


def run_sample(
    lm: LoadedModel,
    method: Method,
    budget_cfg: "float | int | CompressionRatio",
    sample: Sample,
    cfg: EngineConfig,
    profiler: PhaseProfiler | None = None,
) -> dict[str, Any]:
    """Run every turn of a sample and return its record (metrics, timings, memory, predictions).

    Multi-turn samples (golden context) roll back to the end of each turn's prompt and append the next
    turn, uncompressed unless the method evicts every turn (RocketKV). Multi-request samples
    (`meta["mode"] == "multi_request"`) compress the context alone and run every turn, the first included, as
    an independent request on it. With a `profiler`, the prefill and decode phases are measured
    (`kvbench.profiler`) and the record gets a `profile` entry.
    """
    return run_group(lm, [(method, budget_cfg, sample)], cfg, profiler)[0]


@dataclass
class _Row:
    """One (method, budget, sample) of a group while it runs: its session and what its record needs."""

    method: Method
    budget_cfg: "float | int | CompressionRatio"
    sample: Sample
    ctx_ids: list[int]
    q_ids: list[int]
    segment: list[int]
    budget: int
    plan: Plan
    sequence_length: int
    session: Session
    logits: torch.Tensor
    prefill_s: float
    compress_s: float
    reused: bool
    kv_after_compress: int
    kept: list[list[int]]
    kv_after_prefill: int = 0
    prompt_end: int = 0
    turns_out: list[dict[str, Any]] = field(default_factory=list)
    steps: list[float] = field(default_factory=list)


def run_group(
    lm: LoadedModel,
    rows: "list[tuple[Method, float | int | CompressionRatio, Sample]]",
    cfg: EngineConfig,
    profiler: PhaseProfiler | None = None,
) -> list[dict[str, Any]]:
    """Run several (method, budget, sample) rows together and return one record per row, each exactly what
    running it alone gives: every row prefills and compresses on its own (one shared dense prefill per prompt
    through the snapshots), then the rows decode as one batch, each on its own cache with its own hooks and
    stopping, and the teacher-forced NLL steps the same way. Decode times are each row's share of the
    batched steps (`decode_batched_rows` says how many rows there were)."""
    if profiler is not None and len(rows) > 1:
        raise ValueError("a profiled sample runs alone: phases and peaks belong to one point")
    phase = profiler.phase if profiler is not None else (lambda name: contextlib.nullcontext())
    started = time.perf_counter()
    builder = PromptBuilder(lm.tokenizer, cfg.chat_template, cfg.system_prompt)
    with phase("prefill"):
        runs = [_start_row(lm, method, budget_cfg, sample, cfg, builder) for method, budget_cfg, sample in rows]
    stop_ids = stop_token_ids(lm)
    for t in range(max(len(run.sample.turns) for run in runs)):
        turn_runs = [run for run in runs if t < len(run.sample.turns)]
        if t > 0:
            for run in turn_runs:
                multi_request = run.sample.meta.get("mode") == "multi_request"
                run.session.rollback(len(run.ctx_ids) if multi_request else run.prompt_end)
                chunk = builder.request(run.sample, t) if multi_request else builder.next_turn(run.sample, t)
                compress_turn = bool(run.session.schedule and run.session.schedule.every_turn)
                run.logits, _ = run.session.prefill(chunk, compress=compress_turn)
                run.prompt_end = run.session.position
        turns = [run.sample.turns[t] for run in turn_runs]
        targets = [builder._ids(gold_continuation(turn), first=False) if turn.answers else [] for turn in turns]
        sessions, logits = [run.session for run in turn_runs], [run.logits for run in turn_runs]
        nlls = (teacher_forced_nll_batch(sessions, logits, targets, cfg.batch_rows) if cfg.nll
                else [float("nan")] * len(turn_runs))
        min_new = [int(run.sample.meta.get("min_new_tokens", 0)) for run in turn_runs]
        with phase("decode"):
            decoded = decode_batch(sessions, logits, [turn.max_new_tokens for turn in turns], stop_ids,
                                   [run.sample.stop for run in turn_runs], min_new, cfg.batch_rows)
        for run, turn, nll, (tokens, steps, reason), least in zip(turn_runs, turns, nlls, decoded, min_new):
            run.steps += steps
            prediction = lm.tokenizer.decode([tk for tk in tokens if tk not in stop_ids], skip_special_tokens=True)
            for stop in run.sample.stop:
                prediction = prediction.split(stop)[0] if stop in prediction[least:] else prediction
            run.turns_out.append(
                {
                    "prediction": prediction,
                    "answers": turn.answers,
                    "metric": turn.metric,
                    **_score_turn(turn, prediction, list(run.sample.meta.get("extra_metrics", []))),
                    "nll": None if math.isnan(nll) else nll,
                    "new_tokens": len(tokens),
                    "stop_reason": reason,
                    "decode_ms_per_token": 1e3 * sum(steps) / len(steps) if steps else None,
                }
            )
    wall_s = (time.perf_counter() - started) / len(runs)
    records = [_record(lm, run, wall_s, profiler) for run in runs]
    if len(runs) > 1 and cfg.batch_rows > 1:
        for record in records:
            record["decode_batched_rows"] = min(len(runs), cfg.batch_rows)
    return records


def _start_row(lm: LoadedModel, method: Method, budget_cfg: "float | int | CompressionRatio", sample: Sample,
               cfg: EngineConfig, builder: PromptBuilder) -> _Row:
    """Build the row's prompt, then prefill and compress it (and append what follows the compressed segment)."""
    if sample.meta.get("golden_context") is False:
        raise KVBenchError(f"sample {sample.id}: multi-turn with the model's own replies as history "
                           "(golden_context=false) is not implemented; use golden_context=true")
    multi_request = sample.meta.get("mode") == "multi_request"
    ctx_ids, q_ids = builder.first_turn(sample)
    if multi_request:
        q_ids = builder.request(sample, 0)
    ctx_ids = fit_to_model(lm, sample, ctx_ids, q_ids)
    compress_question = cfg.compress_question and not multi_request
    segment = ctx_ids + q_ids if compress_question else ctx_ids
    rest = [] if compress_question else q_ids
    budget = resolve_budget(budget_cfg, len(segment))
    first = sample.turns[0]
    sequence_length = min(len(ctx_ids) + len(q_ids) + first.max_new_tokens, lm.max_positions)
    plan = method.plan(budget, sequence_length=sequence_length, new_tokens=first.max_new_tokens,
                       head_dim=_head_dim(lm))
    if method.last_prompt_token_via_decode:  # the prompt's last token goes through the decode path (RocketKV)
        held_back = (rest or segment)[-1:]
        segment, rest = (segment, rest[:-1]) if rest else (segment[:-1], [])
    else:
        held_back = []
    session, logits, prefill_s, compress_s, reused = _prefill_segment(lm, method, plan, segment, cfg)
    cache = session.cache
    cache.measure_recall = cfg.topk_recall and method.selects
    run = _Row(method, budget_cfg, sample, ctx_ids, q_ids, segment, budget, plan, sequence_length, session, logits,
               prefill_s, compress_s, reused, cache.kv_bytes(), cache.kept_per_head())
    if rest:
        run.logits, rest_s = session.prefill(rest, compress=False)
        run.prefill_s += rest_s
    if held_back:
        _sync(lm.device)
        start = time.perf_counter()
        run.logits = session.forward(held_back)[-1]
        _sync(lm.device)
        run.prefill_s += time.perf_counter() - start
    run.kv_after_prefill = cache.kv_bytes()
    run.prompt_end = session.position
    return run


def _record(lm: LoadedModel, run: _Row, wall_s: float, profiler: PhaseProfiler | None) -> dict[str, Any]:
    """The row's record: metrics, timings, memory and predictions."""
    method, cache, turns_out, plan = run.method, run.session.cache, run.turns_out, run.plan
    profile = None
    if profiler is not None:
        new_tokens = sum(t["new_tokens"] for t in turns_out)
        weights = sum(p.numel() * p.element_size() for p in lm.model.parameters())
        profile = {**profiler.latency(run.prefill_s, run.compress_s, run.steps, new_tokens), **profiler.fields(),
                   # exact accounting, no activations: what CPU figures compare (process RSS carries the
                   # allocator's history across the points of one process). Method state (indexes, rows
                   # moved to host memory) only grows, so its end is its peak
                   "weights_bytes": weights,
                   "state_peak_bytes": weights + cache.kv_peak_bytes + cache.method_state_bytes(),
                   "decode_step_ms": [1e3 * s for s in run.steps]}
    flat_kept = [n for layer in run.kept for n in layer]
    kept_end = [n for layer in cache.kept_per_head() for n in layer]
    schedule = method.schedule()
    config = lm.model.config
    head_dim = _head_dim(lm)
    elem = torch.finfo(lm.dtype).bits // 8
    prompt_tokens = len(run.ctx_ids) + len(run.q_ids)
    scores = [t["score"] for t in turns_out]
    return {
        "sample_id": run.sample.id,
        "task": run.sample.task,
        "score": None if any(s is None for s in scores) else sum(scores) / len(scores),
        "nll": turns_out[0]["nll"],
        "turns": turns_out,
        "prompt_tokens": prompt_tokens,
        "context_tokens": len(run.ctx_ids),
        "compressed_segment_tokens": len(run.segment),
        "budget_tokens": run.budget,
        "compression_ratio": run.budget_cfg.value if isinstance(run.budget_cfg, CompressionRatio) else None,
        "budget_plan": {"evict": plan.evict, "select": plan.select, "sequence_length": run.sequence_length,
                        **plan.derived},
        # selection methods compress the attention of every step; eviction may first fire while decoding
        "compressed": (method.uses_budget and run.budget < len(run.segment)) or cache.evictions() > 0,
        "eviction_schedule": None if schedule is None else {"events": list(schedule.events),
                                                            "block_size": schedule.block_size,
                                                            "decode_every": schedule.decode_every},
        "eviction_events": cache.evictions(),
        "layer_budgets": [layer.budget for layer in cache.layers] if schedule is not None else None,
        "kept_tokens_mean": sum(flat_kept) / len(flat_kept),
        "kept_tokens_min": min(flat_kept),
        "kept_tokens_max": max(flat_kept),
        "kept_tokens_per_head": [list(layer) for layer in run.kept],  # after prefill: [layer][kv head]
        "kept_tokens_end_mean": sum(kept_end) / len(kept_end),
        "kept_tokens_end_max": max(kept_end),
        "kv_peak_entries_per_head": cache.peak_entries_per_head(),  # at any moment, prefill blocks included
        "kv_peak_bytes": cache.kv_peak_bytes,
        "kv_bytes_after_compress": run.kv_after_compress,
        "kv_bytes_after_prefill": run.kv_after_prefill,
        "kv_bytes_end": cache.kv_bytes(),
        "kv_capacity_bytes_end": cache.kv_capacity_bytes(),  # the buffers, append slack included
        "method_state_bytes_end": cache.method_state_bytes(),
        **_decode_accounting(cache, lm, run.sequence_length),
        "kv_bytes_full_prompt": 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * elem * prompt_tokens,
        "prefill_s": run.prefill_s,
        "compress_s": run.compress_s,
        "prefill_reused": run.reused,
        "decode_ms_per_token": 1e3 * sum(run.steps) / len(run.steps) if run.steps else None,
        "new_tokens": sum(t["new_tokens"] for t in turns_out),
        "wall_s": wall_s,  # the whole sample (a group's wall time split evenly): prefill, NLL, decode, scoring
        **({"profile": profile} if profile is not None else {}),
        "meta": run.sample.meta,
    }


def _decode_accounting(cache: KVBenchCache, lm: LoadedModel, sequence_length: int) -> dict[str, Any]:
    """What the decode steps read (the method's cost model) and how much the cache stores, in true bytes and
    in RocketKV Table 1's convention: retained KV tokens / S + auxiliary elements / (S * D), per KV group."""
    stats, config = cache.stats, lm.model.config
    elem = torch.finfo(lm.dtype).bits // 8
    steps = stats.layer_steps / config.num_hidden_layers
    kv_heads = config.num_key_value_heads
    head_dim = cache.layers[0].head_dim
    states = [(layer, state) for layer in cache.layers for state in layer.aux.values()]
    # K/V rows held, wherever they live (a host segment's rows count as retained). A layer stored per query
    # head (SnapKV at head granularity) holds G rows per group, each its own token: a group of G heads keeping
    # budget/G each stores `budget` tokens, RocketKV's 1/c
    retained = sum(sum(layer.lengths()) for layer in cache.layers)
    retained += sum(getattr(state, "kv_tokens", 0) for _, state in states)
    aux = sum(state.paper_elements for _, state in states)
    full = config.num_hidden_layers * kv_heads * sequence_length
    host = sum(state.nbytes() for _, state in states if getattr(state, "on_host", False))
    return {
        "decode_read_bytes_per_step": stats.read_elements * elem / steps if steps else None,
        "decode_read_tokens_per_group": stats.read_token_equivalents / stats.layer_steps if stats.layer_steps else None,
        "decode_moved_bytes_per_step": stats.moved_bytes / steps if steps else None,
        "decode_method_stats": {k: v / stats.extra_steps for k, v in stats.extra_sums.items()} or None,
        "topk_recall": stats.recall_sum / stats.recall_steps if stats.recall_steps else None,
        "storage_ratio_table1": (retained + aux / head_dim) / full,
        "storage_ratio_bytes": (cache.kv_bytes() + cache.method_state_bytes()) / (2 * full * head_dim * elem),
        # placement: what stays on the model's device and what a method moved to host memory
        "device_bytes_end": cache.kv_bytes() + cache.method_state_bytes() - host,
        "host_bytes_end": host,
    }


def _prefill_segment(
    lm: LoadedModel, method: Method, plan: Plan, segment: list[int], cfg: EngineConfig
) -> tuple[Session, torch.Tensor, float, float, bool]:
    """Prefill and compress the segment, from a shared dense snapshot when the method's eviction only needs
    the end of one dense pass (not block-wise, no state accumulated over every query, a short enough window)."""
    schedule = method.schedule()
    one_dense_pass = schedule is None or schedule.block_size is None
    if not (cfg.reuse_prefill and one_dense_pass and not method.observes and method.obs_window <= cfg.snapshot_window):
        session = Session(lm, method, plan)
        logits, seconds = session.prefill(segment, compress=True)
        return session, logits, seconds, 0.0, False
    store = snapshots(cfg.snapshot_cache_mb)
    key = (id(lm.model), lm.dtype, cfg.snapshot_window, tuple(segment))
    hit = store.get(key)
    reused = hit is not None
    if hit is None:
        dense = Session(lm, None, None)
        dense.cache.query_window = cfg.snapshot_window
        logits, seconds = dense.prefill(segment, compress=False)
        store.put(key, dense.cache, logits, seconds)
        hit = (dense.cache, logits, seconds)
    dense_cache, logits, seconds = hit
    cache = dense_cache.clone()
    cache.method, cache.plan = method, plan
    start = time.perf_counter()
    cache.compress()
    compress_s = time.perf_counter() - start
    session = Session(lm, method, plan, cache)
    return session, logits, seconds, compress_s, reused
