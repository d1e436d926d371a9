"""A point's summary: score means (the unweighted mean of subtask means) with their 95% intervals, metric means,
per-turn scores."""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from kvbench.results.stats import bootstrap_interval, sample_cluster
from kvbench.results.store import _atomic_write_json

log = logging.getLogger(__name__)


SUMMARY_FILE = "summary.json"


# Record fields that are identity or structure, never averaged as metrics.
NON_METRIC_FIELDS = frozenset({"sample_id", "task", "score", "turns", "point", "point_hash"})


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def mean_of_subtasks(scores: Iterable[float | None], empty: float | None = None) -> float | None:
    """The unweighted mean of per-subtask mean scores, the RULER/LongBench rule: a suite's subtasks weigh the
    same whatever their sample counts. Subtasks without a value (None) are left out; `empty` when none has one.
    Summaries, `kvbench report`'s point table and the paper tables all average this way (a DataFrame's missing
    values are NaN: they drop them first and pass ``empty=nan``)."""
    values = [s for s in scores if s is not None]
    return sum(values) / len(values) if values else empty


def _unscored(rec: dict[str, Any]) -> bool:
    """A record that has no score by design: synthetic efficiency inputs, or an out-of-memory point."""
    return bool(rec.get("oom")) or all(t.get("metric") == "none" for t in rec.get("turns") or [{}])


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _metric_means(records: list[dict[str, Any]]) -> dict[str, float]:
    """Mean of every numeric top-level field that is not identity or score, over the records having it."""
    values: dict[str, list[float]] = defaultdict(list)
    for rec in records:
        for key, value in rec.items():
            if key not in NON_METRIC_FIELDS and _is_number(value):
                values[key].append(float(value))
    return {key: sum(v) / len(v) for key, v in sorted(values.items())}


def _score_pct(records: list[dict[str, Any]]) -> float | None:
    """Mean score x100 over the records with a numeric score."""
    mean = _mean([float(r["score"]) for r in records if _is_number(r.get("score"))])
    return None if mean is None else 100.0 * mean


def _score_ci(records: list[dict[str, Any]]) -> list[float] | None:
    """The 95% bootstrap interval of the score x100 (stratified by subtask, sampled responses to one problem
    resampled together: `kvbench.results.stats`), as [low, high]; None with fewer than two scored samples (or
    problems) in a subtask."""
    scored = sorted((rec["task"], str(rec["sample_id"]), 100.0 * float(rec["score"]),
                     sample_cluster(rec["sample_id"], rec.get("meta"))) for rec in records if _is_number(rec.get("score")))
    interval = bootstrap_interval([v for _, _, v, _ in scored], [t for t, *_ in scored],
                                  clusters=[c for *_, c in scored]) if scored else None
    return None if interval is None else list(interval)


def _turn_scores(records: list[dict[str, Any]]) -> list[float | None]:
    """Mean score x100 of the i-th turn, over the samples that have one: degradation over a conversation."""
    per_turn: dict[int, list[float]] = defaultdict(list)
    for rec in records:
        for i, turn in enumerate(rec.get("turns") or []):
            if _is_number(turn.get("score")):
                per_turn[i].append(float(turn["score"]))
    n_turns = max(len(rec.get("turns") or []) for rec in records)
    return [100.0 * m if (m := _mean(per_turn[i])) is not None else None for i in range(n_turns)]


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Aggregate one point's records.

    ``score`` is the headline: the unweighted mean of the per-subtask mean scores (x100), the RULER/LongBench
    rule, so a suite's subtasks weigh the same whatever their sample counts; for a single task it equals
    ``score_micro``, the plain mean over samples. ``score_ci``: its 95% bootstrap interval [low, high] (None
    with fewer than two samples in a subtask), also per subtask. ``metrics`` are means of the other numeric record fields.
    ``tasks`` breaks everything down per subtask, plus per-turn scores for multi-turn tasks.
    """
    for rec in records:
        if not isinstance(rec.get("task"), str):
            raise ValueError(f"record {rec.get('sample_id')!r} has no task name")
        if not _is_number(rec.get("score")) and not _unscored(rec):
            log.warning("record %r has no numeric score; excluded from score means", rec.get("sample_id"))
    hashes = {rec["point_hash"] for rec in records if "point_hash" in rec}
    if len(hashes) > 1:
        raise ValueError(f"records from several points ({', '.join(sorted(hashes))}) cannot be summarised together")

    by_task: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for rec in records:
        by_task[rec["task"]].append(rec)
    tasks: dict[str, dict[str, Any]] = {}
    for name, recs in sorted(by_task.items()):
        tasks[name] = {"n": len(recs), "score": _score_pct(recs), "score_ci": _score_ci(recs),
                       "metrics": _metric_means(recs)}
        if any(len(r.get("turns") or []) > 1 for r in recs):
            tasks[name]["turn_scores"] = _turn_scores(recs)

    summary: dict[str, Any] = {
        "n_samples": len(records),
        "score": mean_of_subtasks(t["score"] for t in tasks.values()),
        "score_ci": _score_ci(records),
        "score_micro": _score_pct(records),
        "metrics": _metric_means(records),
        "tasks": tasks,
    }
    if records and "point" in records[0]:
        summary["point"] = records[0]["point"]
    if hashes:
        summary["point_hash"] = hashes.pop()
    return summary


def write_summary(run_dir: Path, summary: Mapping[str, Any]) -> None:
    """Store the summary atomically; it is derived data, so it is simply replaced on every update."""
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    _atomic_write_json(Path(run_dir) / SUMMARY_FILE, summary)
