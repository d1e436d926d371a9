"""Running one sample: build the prompt, prefill, compress, decode (greedily, or by the task's seeded sampling
protocol: `kvbench.engine.decoding`), score.

The data flow for a single-turn sample, question-aware (`compress_question=true`):

    [context + question + answer prefix] --prefill--> compress (method's prefill hook) --> decode

and question-agnostic (`compress_question=false`, the KVPress protocol Ada-KV follows):

    [context] --prefill--> compress --> [question + answer prefix] appended uncompressed --> decode

Later turns of a multi-turn sample roll the cache back to the end of the previous prompt (golden-context
mode: the gold answer, not the model's reply, becomes the history), append the next chunk uncompressed and
decode again. Positions are explicit logical positions, so RoPE stays right whatever was evicted.

Eviction after a dense prefill does not change the prefill itself, so with `reuse_prefill` one dense prefill
per prompt serves every method and budget of a sweep (`PrefillSnapshots`, owned by the caller: the run layer
shares one across the points of a process); eviction then runs from the captured observation-window queries
through exactly the same hook. Turn it off to measure memory peaks.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import time
from typing import Any

import torch

from kvbench.core.budget import CompressionRatio, resolve_budget
from kvbench.core.contract import Plan
from kvbench.core.devices import sync
from kvbench.core.errors import KVBenchError
from kvbench.engine.compiled import decoder_for, wants_compile
from kvbench.engine.config import EngineConfig
from kvbench.engine.decoding import TokenChooser, decoding_for
from kvbench.engine.invariance import batch_invariance
from kvbench.engine.prompt import PromptBuilder, fit_to_model, gold_continuation, stop_token_ids
from kvbench.engine.record import SampleRun, _record
from kvbench.engine.session import Session, decode_batch, teacher_forced_nll_batch
from kvbench.engine.snapshots import PrefillSnapshots
from kvbench.methods.base import Method
from kvbench.models import LoadedModel, model_head_dim
from kvbench.profiling.profiler import PhaseProfiler
from kvbench.tasks.base import Sample
from kvbench.tasks.scoring import score as score_prediction


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
    snapshots: PrefillSnapshots | None = None,
) -> dict[str, Any]:
    """Run every turn of a sample and return its record (metrics, timings, memory, predictions).

    Multi-turn samples (golden context) roll back to the end of each turn's prompt and append the next
    turn, uncompressed unless the method evicts every turn (RocketKV). Multi-request samples
    (`meta["mode"] == "multi_request"`) compress the context alone and run every turn, the first included, as
    an independent request on it. With a `profiler`, the prefill and decode phases are measured
    (`kvbench.profiling.profiler`) and the record gets a `profile` entry. `snapshots`: the dense prefills to
    reuse and add to (with `cfg.reuse_prefill`); without it the call shares none with any other.
    """
    return run_group(lm, [(method, budget_cfg, sample)], cfg, profiler, snapshots)[0]


def run_group(
    lm: LoadedModel,
    rows: "list[tuple[Method, float | int | CompressionRatio, Sample]]",
    cfg: EngineConfig,
    profiler: PhaseProfiler | None = None,
    snapshots: PrefillSnapshots | None = None,
) -> list[dict[str, Any]]:
    """Run several (method, budget, sample) rows together and return one record per row, each exactly what
    running it alone gives: every row prefills and compresses on its own (one shared dense prefill per prompt
    through `snapshots`; without it, a store private to this call), then the rows decode as one batch, each on
    its own cache with its own hooks and stopping, and the teacher-forced NLL steps the same way. Decode times
    are each row's share of the batched steps (`decode_batched_rows` says how many rows there were)."""
    if profiler is not None and len(rows) > 1:
        raise ValueError("a profiled sample runs alone: phases and peaks belong to one point")
    if snapshots is None:
        snapshots = PrefillSnapshots(cfg.snapshot_cache_mb)
    phase = profiler.phase if profiler is not None else (lambda name: contextlib.nullcontext())
    started = time.perf_counter()
    builder = PromptBuilder(lm.tokenizer, cfg.chat_template, cfg.system_prompt)
    with phase("prefill"):
        runs = [_start_row(lm, method, budget_cfg, sample, cfg, builder, snapshots)
                for method, budget_cfg, sample in rows]
    row_block = cfg.resolved_row_block(lm.device)
    max_rows = min(len(runs), cfg.batch_rows)
    # one row at a time where this machine would round a batched row otherwise than a lone one
    batch_reason = batch_invariance(lm, max_rows, row_block) if max_rows > 1 else None
    if batch_reason is not None:
        max_rows = 1
    choosers = {id(run): TokenChooser(run.decoding) for run in runs}  # one generator per sample, across its turns
    stage_timed = profiler is not None and profiler.stages is not None
    for run in runs:
        run.session.row_block = row_block
        _choose_decode_path(lm, run.session, cfg, stage_timed)
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
        nlls = (teacher_forced_nll_batch(sessions, logits, targets, max_rows) if cfg.nll
                else [float("nan")] * len(turn_runs))
        min_new = [int(run.sample.meta.get("min_new_tokens", 0)) for run in turn_runs]
        with phase("decode"):
            decoded = decode_batch(sessions, logits, [turn.max_new_tokens for turn in turns], stop_ids,
                                   [run.sample.stop for run in turn_runs], min_new, max_rows,
                                   choosers=[choosers[id(run)] for run in turn_runs])
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
    for run, record in zip(runs, records):
        if run.session.steps_taken:
            record["decode_row_block"] = row_block
            record["decode_batched_rows"] = max(1, run.session.rows_shared)  # the most rows that shared a forward
        if batch_reason is not None:
            record["decode_batch_reason"] = batch_reason
        elif len(runs) > 1 and run.session.decode_path == "compiled":
            record["decode_batch_reason"] = "a compiled decode step is one graph per row: compiled rows step alone"
    return records


# a compiled step is one graph (one CUDA graph replay on a GPU): there is no stage boundary inside it to time
STAGE_TIMED_REASON = "profiler.stages times the eager step's stages (a compiled step has none to time)"


def sample_generator(seed: int, sample_id: str) -> torch.Generator:
    """The generator a stochastic method draws from for one sample (`Step.generator`): a CPU generator seeded
    from the run's seed and the sample's id, never from the sample's place in a batch or a sweep, so a point
    draws the same alone as in a grouped run, and on a rerun; two samples of the same length draw differently."""
    digest = hashlib.sha256(f"{seed}\0{sample_id}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def _choose_decode_path(lm: LoadedModel, session: Session, cfg: EngineConfig, stage_timed: bool = False) -> None:
    """The compiled decode step where `engine.compile` asks for it and the method allows it; otherwise eager, and
    the session says why when compiling was asked for."""
    if not wants_compile(cfg.compile, lm.device):
        return
    blocker = (STAGE_TIMED_REASON if stage_timed
               else session.method.static_decode_blocker() if session.method is not None else None)
    decoder = decoder_for(lm)
    blocker = blocker or decoder.failure(session.method)
    if blocker is not None:
        session.decode_path_reason = blocker
    else:
        session.decoder = decoder


def _start_row(lm: LoadedModel, method: Method, budget_cfg: "float | int | CompressionRatio", sample: Sample,
               cfg: EngineConfig, builder: PromptBuilder, snapshots: PrefillSnapshots) -> SampleRun:
    """Build the row's prompt, then prefill and compress it (and append what follows the compressed segment)."""
    if sample.meta.get("golden_context") is False:
        raise KVBenchError(f"sample {sample.id}: multi-turn with the model's own replies as history "
                           "(golden_context=false) is not implemented; use golden_context=true")
    decoding = decoding_for(sample, cfg.sampling, cfg.seed)  # a bad protocol value fails before any forward
    multi_request = sample.meta.get("mode") == "multi_request"
    ctx_ids, q_ids = builder.first_turn(sample)
    if multi_request:
        q_ids = builder.request(sample, 0)
    untruncated = ctx_ids
    ctx_ids = fit_to_model(lm, sample, ctx_ids, q_ids)
    compress_question = cfg.compress_question and not multi_request
    segment = ctx_ids + q_ids if compress_question else ctx_ids
    appended = [] if compress_question else q_ids
    budget = resolve_budget(budget_cfg, len(segment))
    first = sample.turns[0]
    sequence_length = min(len(ctx_ids) + len(q_ids) + first.max_new_tokens, lm.max_positions)
    plan = method.plan(budget, sequence_length=sequence_length, new_tokens=first.max_new_tokens,
                       head_dim=model_head_dim(lm), num_layers=lm.model.config.num_hidden_layers)
    if method.last_prompt_token_via_decode:  # the prompt's last token goes through the decode path (RocketKV)
        held_back = (appended or segment)[-1:]
        segment, appended = (segment, appended[:-1]) if appended else (segment[:-1], [])
    else:
        held_back = []
    generator = sample_generator(cfg.seed, sample.id)
    session, logits, prefill_s, compress_s, reused = _prefill_segment(lm, method, plan, segment, cfg, snapshots,
                                                                      generator)
    evidence = builder.evidence_positions(sample) if ctx_ids is untruncated else None
    if evidence is not None:  # where the task knows its answer lies, for a method's own diagnostics (InfLLM)
        session.shared["evidence_positions"] = evidence
    cache = session.cache
    session.measure_recall = cfg.topk_recall and method.selects
    run = SampleRun(method, budget_cfg, sample, ctx_ids, q_ids, segment, budget, plan, sequence_length, session, logits,
               prefill_s, compress_s, reused, cache.kv_bytes(), cache.kept_per_head(),
               decoding=decoding)
    if appended:
        run.logits, appended_s = session.prefill(appended, compress=False)
        run.prefill_s += appended_s
    if held_back:
        sync(lm.device)
        start = time.perf_counter()
        run.logits = session.forward(held_back)[-1]
        sync(lm.device)
        run.prefill_s += time.perf_counter() - start
    run.kv_after_prefill = cache.kv_bytes()
    run.prompt_end = session.position
    return run


def _prefill_segment(
    lm: LoadedModel, method: Method, plan: Plan, segment: list[int], cfg: EngineConfig, snapshots: PrefillSnapshots,
    generator: torch.Generator,
) -> tuple[Session, torch.Tensor, float, float, bool]:
    """Prefill and compress the segment, from a dense snapshot in `snapshots` (taken now on a miss) when the
    method's eviction only needs the end of one dense pass (not block-wise, no state accumulated over every
    query, a short enough window)."""
    schedule = method.schedule()
    one_dense_pass = schedule is None or schedule.block_size is None
    prefill_attention = cfg.prefill_attention_function()
    if not (cfg.reuse_prefill and one_dense_pass and not method.observes and method.obs_window <= cfg.snapshot_window):
        session = Session(lm, method, plan, generator=generator)
        session.prefill_attention = prefill_attention
        logits, seconds = session.prefill(segment, compress=True)
        return session, logits, seconds, 0.0, False
    key = (id(lm.model), lm.dtype, cfg.snapshot_window, tuple(segment), *cfg.prefill_key())
    hit = snapshots.get(key)
    reused = hit is not None
    if hit is None:
        dense = Session(lm, None, None)
        dense.prefill_attention = prefill_attention
        dense.query_window = cfg.snapshot_window
        logits, seconds = dense.prefill(segment, compress=False)
        snapshots.put(key, dense.cache, logits, seconds)
        hit = (dense.cache, logits, seconds)
    dense_cache, logits, seconds = hit
    session = Session(lm, method, plan, dense_cache.clone(), generator=generator)
    start = time.perf_counter()
    session.evict_deferred()
    compress_s = time.perf_counter() - start
    return session, logits, seconds, compress_s, reused
