"""Running (or resuming) one experiment point: one Hydra job of `python -m kvbench`.

A point is (model, task, method, budget, mode, engine settings, seed). Its run directory is derived from the
point itself (no timestamps), so re-running an interrupted command finds the records already written and
only computes the missing samples.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from kvbench.core.errors import KVBenchError
from kvbench.results.store import RECORDS_FILE, point_lock
from kvbench.results.summary import summarize, write_summary
from kvbench.run.caches import release_host_memory
from kvbench.run.group import recorded_with_group
from kvbench.run.policy import run_rows
from kvbench.run.prepare import PreparedPoint, prepare_point
from kvbench.run.progress import SampleProgress, sample_count

log = logging.getLogger("kvbench")


def run_point(cfg: DictConfig) -> dict[str, Any]:
    """Run (or resume) one experiment point and return its summary."""
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    with point_lock(run_dir):
        try:
            prepared = prepare_point(cfg, run_dir)
        except KVBenchError:
            if not (run_dir / RECORDS_FILE).exists():  # nothing recorded: leave no empty point behind
                _remove_empty_point(run_dir, Path(str(cfg.results_dir)))
            raise
        return _run_prepared(prepared)


def _remove_empty_point(run_dir: Path, results_dir: Path) -> None:
    """Remove a point directory that holds no records, and the task / model / method directories above it
    that Hydra created for it and that hold nothing else (up to `results_dir`, which stays)."""
    shutil.rmtree(run_dir, ignore_errors=True)
    root = results_dir.resolve()
    for parent in run_dir.resolve().parents:
        if parent == root or root not in parent.parents:
            break
        try:
            parent.rmdir()  # only an empty directory: another point's records stop the walk
        except OSError:
            break


def _run_prepared(prepared: PreparedPoint) -> dict[str, Any]:
    cfg = prepared.cfg
    todo = prepared.todo()
    recorded, grouped = len(prepared.samples) - len(todo), recorded_with_group(prepared.run_dir)
    if recorded and grouped >= recorded:  # all of them just now, in the sweep's grouped phase: nothing resumes
        log.info("%s: %d of %d samples recorded with its group", prepared.run_dir.name, recorded,
                 len(prepared.samples))
    elif recorded:
        log.info("resuming %s: %d of %d samples already recorded%s", prepared.run_dir, recorded,
                 len(prepared.samples), f" ({grouped} of them just now, with its group)" if grouped else "")
    if todo:
        log.info("%s: %s to run", prepared.run_dir.name, sample_count(todo, cfg.task.get("num_samples")))
    bar = SampleProgress(len(todo), f"{cfg.method.name} b={prepared.budget} {cfg.task.name}", cfg.show_progress)
    batch = 1 if cfg.profile else max(1, int(prepared.engine_cfg.sample_batch))
    for start in range(0, len(todo), batch):
        records = run_rows(prepared, [(prepared, sample) for sample in todo[start:start + batch]])
        scores = [r["score"] for r in records if r.get("score") is not None]
        bar.update(len(records), **({"score": f"{scores[-1]:.2f}"} if scores else {}))
        release_host_memory()
    bar.close()
    records = prepared.store.records()
    summary = summarize(records)
    summary.update(point=prepared.point_fields, point_hash=prepared.phash, run_dir=str(prepared.run_dir))
    suite = records[0].get("meta", {}).get("suite") if records else None
    if suite and suite.get("skipped"):  # e.g. RULER without its QA data: say the average is partial
        summary["suite_skipped"] = suite["skipped"]
    write_summary(prepared.run_dir, summary)
    key = prepared.run_dir.resolve()
    if key in _PRINTED and not todo:  # e.g. `-m method=full,snapkv budget=128,256`: full's budgets are one point
        log.info("%s: the same point as an earlier job of this sweep, summary above", prepared.run_dir.name)
    else:
        _print_summary(summary)
        _PRINTED.add(key)
    return summary


# Points whose summary this process printed: a sweep's jobs that name one point (a budget that does not apply to
# the method) print it once.
_PRINTED: set[Path] = set()


def _interval(summary: dict[str, Any]) -> str:
    """` [37.78, 60.00]`: a summary's 95% interval of its score, or nothing without one."""
    ci = summary.get("score_ci")
    return f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else ""


def _print_summary(summary: dict[str, Any]) -> None:
    point = summary["point"]
    budget = "-" if point["budget"] is None else point["budget"]
    score = "-" if summary["score"] is None else f"{summary['score']:.2f}" + _interval(summary)
    lines = [f"{point['method']} budget={budget} on {point['task']} ({point['model']}): "
             f"score {score} over {summary['n_samples']} samples"]
    if summary.get("suite_skipped"):
        lines.append(f"  (mean of {len(summary['tasks'])} subtasks; skipped for missing data: "
                     f"{', '.join(summary['suite_skipped'])})")
    if len(summary["tasks"]) > 1:
        for task, value in sorted(summary["tasks"].items()):
            lines.append(f"  {task:<32} {value['score']:7.2f}{_interval(value)}  (n={value['n']})")
    for key in ("nll", "kept_tokens_mean", "kv_bytes_after_prefill", "prefill_s", "decode_ms_per_token"):
        if summary["metrics"].get(key) is not None:
            lines.append(f"  {key:<32} {summary['metrics'][key]:.4g}")
    print("\n".join(lines), flush=True)
