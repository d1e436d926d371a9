"""The record of one sample (the schema every results table reads): metrics, timings, memory, traffic and
storage accounting, predictions."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvbench.cache.kvcache import KVBenchCache
from kvbench.core.budget import CompressionRatio
from kvbench.core.contract import Plan
from kvbench.engine.decoding import GREEDY, Decoding
from kvbench.engine.session import Session
from kvbench.kernels.decode_attention import decode_attention_kind
from kvbench.methods.base import Method
from kvbench.models import LoadedModel, model_head_dim
from kvbench.profiling.profiler import PhaseProfiler
from kvbench.tasks.base import Sample


@dataclass
class SampleRun:
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
    decoding: Decoding = GREEDY  # how its tokens are picked (kvbench.engine.decoding)


def _record(lm: LoadedModel, run: SampleRun, wall_s: float, profiler: PhaseProfiler | None) -> dict[str, Any]:
    """The row's record: metrics, timings, memory and predictions."""
    method, cache, turns_out, plan = run.method, run.session.cache, run.turns_out, run.plan
    profile = None
    if profiler is not None:
        new_tokens = sum(t["new_tokens"] for t in turns_out)
        weights_by_device = lm.weight_bytes_by_device()  # quantised weights at their real size
        weights = sum(weights_by_device.values())
        profile = {**profiler.latency(run.prefill_s, run.compress_s, run.steps, new_tokens), **profiler.fields(),
                   # exact accounting, no activations: what CPU figures compare (process RSS carries the
                   # allocator's history across the points of one process). Method state (indexes, rows
                   # moved to host memory) only grows, so its end is its peak
                   "weights_bytes": weights,
                   **({"weights_bytes_by_device": weights_by_device} if len(weights_by_device) > 1 else {}),
                   "state_peak_bytes": weights + cache.kv_peak_bytes + cache.method_state_bytes(),
                   "decode_step_ms": [1e3 * s for s in run.steps]}
    flat_kept = [n for layer in run.kept for n in layer]
    kept_end = [n for layer in cache.kept_per_head() for n in layer]
    schedule = method.schedule()
    config = lm.model.config
    head_dim = model_head_dim(lm)
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
        # which decode step ran (kvbench.engine.compiled): eager, or compiled on the static layout; why not
        # compiled where compiling was asked for; the calls that compiled (their time is not in the steps')
        "decode_path": run.session.decode_path,
        "decode_path_reason": _path_reason(run.session),
        "decode_compiles": run.session.compiles,
        # compiled steps that ran their graph without dynamo's guards (a CUDA-graph replay on a GPU)
        "decode_replayed_steps": run.session.replayed_steps,
        "decode_attention": dense_decode_attention(run.session, lm),
        "decode_compile_s": run.session.compile_s,
        "new_tokens": sum(t["new_tokens"] for t in turns_out),
        # greedy, or sampled with its temperature, top-p, top-k and seed (the draws are the sample's own)
        "decoding": run.decoding.record(),
        "wall_s": wall_s,  # the whole sample (a group's wall time split evenly): prefill, NLL, decode, scoring
        **({"profile": profile} if profile is not None else {}),
        "meta": run.sample.meta,
    }


def dense_decode_attention(session: Any, lm: LoadedModel) -> str | None:
    """Which attention the dense decode steps ran, so that an efficiency figure names the baseline it divides by:
    `repeated_kv_masked` (RocketKV's and gpt-fast's Full-KV baseline: K/V copied to every query head, the whole
    capacity attended, masked), `flash_decode` (the split-K kernel over each head's held rows: the compiled step
    on CUDA), `masked_capacity` (the compiled step's PyTorch attention over the whole capacity, masked: CPU), or
    the eager path's kind (`kernels.decode_attention.decode_attention_kind`). None without decode steps."""
    if session.decode_path is None:
        return None
    if session.method is not None and session.method.repeats_kv:
        return "repeated_kv_masked" if session.decode_path == "compiled" else "repeated_kv"
    if session.decode_path == "compiled":
        return "flash_decode" if session.static_flash_decode else "masked_capacity"
    return decode_attention_kind(lm.dtype, lm.device)


def _decode_accounting(cache: KVBenchCache, lm: LoadedModel, sequence_length: int) -> dict[str, Any]:
    """What the decode steps read (the method's cost model) and how much the cache stores, in true bytes and
    in RocketKV Table 1's convention: retained KV tokens / S + auxiliary elements / (S * D), per KV group."""
    stats, config = cache.stats, lm.model.config
    elem = torch.finfo(lm.dtype).bits // 8
    steps = stats.layer_steps / config.num_hidden_layers
    kv_heads = config.num_key_value_heads
    head_dim = cache.layers[0].head_dim
    states = [(layer, state) for layer in cache.layers for state in layer.derived.values()]
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
        # the paper's axis beside the traffic one: K/V rows each query head attended per layer and step
        "decode_attended_tokens_per_head": stats.attended_tokens / stats.layer_steps if stats.layer_steps else None,
        "decode_moved_bytes_per_step": stats.moved_bytes / steps if steps else None,
        "decode_method_stats": {k: v / stats.extra_steps for k, v in stats.extra_sums.items()} or None,
        "topk_recall": stats.recall_sum / stats.recall_steps if stats.recall_steps else None,
        "storage_ratio_table1": (retained + aux / head_dim) / full,
        "storage_ratio_bytes": (cache.kv_bytes() + cache.method_state_bytes()) / (2 * full * head_dim * elem),
        # placement: what stays on the model's device and what a method moved to host memory
        "device_bytes_end": cache.kv_bytes() + cache.method_state_bytes() - host,
        "host_bytes_end": host,
    }


# a compiled session whose decode steps all ran eagerly: each loop's first step evicts eagerly (`Session`), and no
# loop of this sample had a step after it
EAGER_FIRST_ONLY = ("each decode loop's first step runs eagerly (the method evicts while decoding) and this sample's "
                    "loops had no later step")


def _path_reason(session) -> str | None:
    """Why the decode path is not the compiled one although compiling was asked for (None when it is, or was not
    asked for)."""
    if session.decode_path_reason is None and session.decoder is not None and session.decode_path == "eager":
        return EAGER_FIRST_ONLY
    return session.decode_path_reason

