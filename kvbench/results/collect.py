"""Reading a results tree as a table: one row per record with its point's identity and run config as columns."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pandas as pd

import json
import logging
import math
import os
from collections import defaultdict
from pathlib import Path

from kvbench.config.paths import POINT_GROUPS, experiment_config, experiments
from kvbench.core.errors import KVBenchError
from kvbench.results.manifest import MANIFEST_FILE
from kvbench.results.stats import frame_estimate, sample_cluster
from kvbench.results.store import RECORDS_FILE, load_records
from kvbench.results.summary import _is_number

log = logging.getLogger(__name__)


# Record fields that are not table columns: structure, or renamed (a record's `task` is its subtask).
_NESTED_RECORD_FIELDS = ("point", "turns", "task")


# Dict fields that are not flattened into columns: per-sample task data (needle offsets, ...).
_UNFLATTENED_RECORD_FIELDS = ("point", "meta")


# A record's point fields (`point`, written by run.prepare) that a sweep varies, in the record's order: the
# columns that identify a point in a table when a frame does not list its own (reporting.paper_tables.IDENTITY
# has the same fields in a paper's row order).
POINT_FIELDS = ("model", "task", "method", "budget", "seq_len", "compress_question", "dtype")


# Sections and keys of a run directory's config.yaml that become columns (`method.window`, `task.seq_len`, ...):
# the names a sweep overrides, so a preset's grid can be matched against the records. Config sections, not
# record fields: what run.identity.POINT_KEYS hashes, plus compression_ratio and profiling, whole (a column
# per setting, the engine's non-identity settings included).
CONFIG_COLUMNS = ("model", "method", "task", "engine", "budget", "compression_ratio", "compress_question", "seed",
                  "profile", "profiler")


# Per-sample task data kept as columns: NIAH's cell (length, depth), Math-500's generation limit.
META_COLUMNS = ("length", "depth", "seq_len")


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    """Flatten nested dicts into dotted columns; lists become JSON text so they can be group keys."""
    if isinstance(value, dict):
        for key, sub in value.items():
            _flatten(f"{prefix}.{key}" if prefix else str(key), sub, out)
    elif isinstance(value, list):
        out[prefix] = json.dumps(value)
    else:
        out[prefix] = value


def _run_config(run_dir: Path) -> dict[str, Any]:
    """The run directory's resolved config (config.yaml), flattened; empty when it has none."""
    import yaml

    path = run_dir / "config.yaml"
    try:
        cfg = yaml.safe_load(path.read_text(encoding="utf-8")) if path.exists() else None
    except (OSError, yaml.YAMLError) as err:
        log.warning("%s: unreadable config (%s); its config columns are left empty", path, err)
        cfg = None
    flat: dict[str, Any] = {}
    for key in CONFIG_COLUMNS:
        if isinstance(cfg, dict) and key in cfg:
            _flatten(key, cfg[key], flat)
    # the config files the point was composed from (`method=snapkv_head` is SnapKV with per-head selection):
    # what a sweep names, so what a report matches and shows
    hydra_file = run_dir / ".hydra" / "hydra.yaml"
    if hydra_file.exists():
        try:
            choices = (yaml.safe_load(hydra_file.read_text(encoding="utf-8")) or {}).get("hydra", {}).get(
                "runtime", {}).get("choices", {})
        except (OSError, yaml.YAMLError):
            choices = {}
        flat.update({f"choice.{k}": v for k, v in choices.items() if k in (*POINT_GROUPS, "experiment")})
    return flat


def collect(results_root: Path) -> "pd.DataFrame":
    """One row per record under `results_root`: its fields, its point's identity, its run's config and its
    subtask. Reading never modifies a run directory (see `load_records`), so it is safe on a live sweep.

    A record's ``task`` is its subtask (``subtask`` column); the point's ``task`` is the task config (a suite
    name for suites). ``attrs["point_columns"]`` lists the columns that came from point identities. Nested
    record fields are dotted columns (``profile.ttft_s``); the run's config adds ``method.window``,
    ``task.seq_len``, ... where no record field has that name; per-head lists stay JSON text.
    """
    import pandas as pd

    root = Path(results_root)
    rows: list[dict[str, Any]] = []
    point_columns: dict[str, None] = {}  # ordered set
    for path in sorted(root.rglob(RECORDS_FILE)):
        run_dir = path.parent
        config = _run_config(run_dir)
        for rec in load_records(run_dir):
            row = {k: v for k, v in rec.items() if k not in _NESTED_RECORD_FIELDS and not isinstance(v, (dict, list))}
            for key, value in rec.items():  # e.g. budget_plan.k1, eviction_schedule.block_size
                if isinstance(value, dict) and key not in _UNFLATTENED_RECORD_FIELDS:
                    _flatten(key, value, row)
                elif isinstance(value, list) and key not in _NESTED_RECORD_FIELDS:
                    row[key] = json.dumps(value)
            extra: dict[str, list[float]] = defaultdict(list)  # a task's secondary metrics (Math-500 exact match)
            for turn in rec.get("turns") or []:
                for name, value in (turn.get("extra_scores") or {}).items():
                    if _is_number(value):
                        extra[name].append(float(value))
            row.update({f"extra.{name}": sum(v) / len(v) for name, v in extra.items()})
            meta = rec.get("meta") or {}
            row.update({f"meta.{k}": meta[k] for k in META_COLUMNS if k in meta})
            row["subtask"] = rec.get("task")
            row["cluster"] = sample_cluster(rec.get("sample_id"), meta)  # what the bootstrap resamples
            row["n_turns"] = len(rec.get("turns") or [])
            if row["n_turns"] > 1:  # a conversation: each round's score (a report's `columns: turn`)
                row["turn_scores"] = json.dumps([turn.get("score") for turn in rec["turns"]])
            point: dict[str, Any] = {}
            _flatten("", rec.get("point") or {}, point)
            point_columns.update(dict.fromkeys(point))
            row.update(point)
            for key, value in config.items():
                row.setdefault(key, value)
            row["run_dir"] = str(run_dir.relative_to(root))
            rows.append(row)
    df = pd.DataFrame(rows)
    df.attrs["point_columns"] = list(point_columns)
    df.attrs["root"] = str(root)
    return df


def recorded_identity(run_dir: Path) -> dict[str, Any] | None:
    """The identity a point directory was stored under (its manifest's ``point``: `run.identity.point_identity`
    of its config); None when it has no readable manifest."""
    try:
        manifest = json.loads((Path(run_dir) / MANIFEST_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    point = manifest.get("point") if isinstance(manifest, dict) else None
    return point if isinstance(point, dict) else None


def results_root(source: str | os.PathLike[str]) -> Path:
    """The results directory of `source`: a directory as given, or an experiment preset's ``results_dir``."""
    path = Path(source)
    if path.is_dir():
        return path
    if str(source) in experiments():
        return Path(experiment_config(str(source)).results_dir)
    raise KVBenchError(f"{source}: neither a results directory nor an experiment (experiments: "
                       f"{', '.join(experiments())})")


def load(source: str | os.PathLike[str], results_dir: str | os.PathLike[str] | None = None) -> "pd.DataFrame":
    """All records of an experiment preset (``load("adakv_fig4")``, read from its ``results_dir``, or from
    `results_dir` where the sweep wrote elsewhere) or of a results directory, one row per record with the
    point's config flattened into columns (see `collect`). Finding no records is an error naming where it looked:
    an empty frame would read as "no results" rather than "wrong place"."""
    root = results_root(source)
    if results_dir is not None:
        root = Path(results_dir)
    df = collect(root)
    if df.empty:
        where = str(root) if root.is_absolute() else f"{root} ({root.resolve()}, relative to the current directory)"
        hint = ("" if results_dir is not None or Path(source).is_dir() else
                f"; pass load({str(source)!r}, results_dir=...) with the directory the sweep wrote to")
        raise KVBenchError(f"no records under {where}{hint}")
    return df


def scores(records: "pd.DataFrame", by_subtask: bool = False) -> "pd.DataFrame":
    """The score of every point of `records` (a frame of `load`), one row per point (and subtask, with
    `by_subtask`): its identity, sample count ``n``, ``score`` x100 (a suite's: the unweighted mean of its
    subtasks' means, as every table prints it) and the 95% bootstrap interval ``ci_low``, ``ci_high``
    (`kvbench.results.stats`; NaN with fewer than two samples in a subtask). Points are told apart by their
    hash, so two dtypes or code-identified settings never share a row."""
    import pandas as pd

    key = "point_hash" if "point_hash" in records.columns and records["point_hash"].notna().all() else "run_dir"
    named = records.attrs.get("point_columns") or POINT_FIELDS
    identity = [c for c in named if c in records.columns and c != key]
    groups = [key, "subtask"] if by_subtask else [key]
    rows = []
    for _, part in records.groupby(groups, sort=False, dropna=False):
        found = frame_estimate(part.assign(score=pd.to_numeric(part["score"], errors="coerce") * 100.0))
        row = {c: part[c].iloc[0] for c in (*identity, *groups)}
        row.update(n=len(part), score=found.value if found else math.nan,
                   ci_low=found.low if found and found.has_interval else math.nan,
                   ci_high=found.high if found and found.has_interval else math.nan)
        rows.append(row)
    return pd.DataFrame(rows, columns=[*identity, *groups, "n", "score", "ci_low", "ci_high"])
