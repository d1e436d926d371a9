"""Aggregate the records of many run directories into tables, from the command line or after a Hydra sweep.

Everything is recomputed from ``records.jsonl`` files (never from ``summary.json``), so a report is correct
for partially finished, resumed or re-scored points, and reading never modifies a run directory: reports
may run while a sweep is still writing.

    kvbench report experiment=NAME | RESULTS_DIR [--out DIR] [--publish] [--csv FILE] [--markdown] [--pivot a,b]

prints the point table and writes the paper's layout (kvbench/reporting/paper.py) under <results_dir>/report/.
A printed table shows what differs between its rows, under one line naming the settings they share; the CSV
files hold every column.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from kvbench.results.collect import POINT_FIELDS, _flatten, collect
from kvbench.results.stats import Estimate, frame_estimate, frame_resampled_unit
from kvbench.results.summary import mean_of_subtasks

log = logging.getLogger(__name__)


# Per-(point, subtask) means reported by `point_table`, when the records have them.
TABLE_METRICS = ("nll", "kept_tokens_mean", "kv_bytes_after_prefill", "decode_ms_per_token")


# Per-(point, subtask) totals reported by `point_table` beside the means, summed over the records: the seconds
# the compiled decode step spent compiling (`engine.compile`; one graph per point and capacity, each compile
# counted in the record of the sample that paid it). A table shows them where any is non-zero.
TABLE_TOTALS = ("decode_compile_s",)


# How many points' rows shared a decode forward (grouped and batched decoding). A table shows it beside ms/token
# where any point shared its steps: that ms/token is the shared step's time divided by its rows, a sweep's
# throughput, not the method's own latency.
SHARED_ROWS = "decode_batched_rows"


# Short names of the metrics in a printed table (the CSV keeps the record names); KV bytes are printed in MiB.
DISPLAY_NAMES = {"kept_tokens_mean": "kept", "kv_bytes_after_prefill": "KV MiB", "decode_ms_per_token": "ms/token",
                 "decode_compile_s": "compile s", SHARED_ROWS: "rows/step"}


SHARED_ROWS_LEGEND = ("ms/token of a point whose rows/step is over 1: its share of steps decoded together with "
                      "other points (the step's time / its rows), not the method's own latency; profile=true "
                      "times a point alone")


# Columns a printed table always shows, constant or not: the comparison's axes and what was measured.
ALWAYS_SHOWN = ("method", "budget", "score", *TABLE_METRICS, *TABLE_TOTALS)


# Label of the row holding a suite's unweighted mean over its subtasks.
TASK_MEAN_LABEL = "[task mean]"


def _point_keys(df: pd.DataFrame) -> list[str]:
    """Columns identifying a point: its recorded identity, plus the hash that also covers hidden settings
    (seed, engine options), so two points never merge just because their visible fields agree. Records
    without any identity fall back to their run directory."""
    keys = df.attrs.get("point_columns") or [k for k in POINT_FIELDS if k in df.columns]
    if "point_hash" in df.columns and "point_hash" not in keys:
        keys = [*keys, "point_hash"]
    return keys or ["run_dir"]


def _sorted(df: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """`df` stably sorted by `keys`, or in its current order when the keys do not compare."""
    if not keys:
        return df.reset_index(drop=True)
    try:
        return df.sort_values(keys, kind="stable").reset_index(drop=True)
    except TypeError:  # mixed types in a key column (e.g. budgets as numbers and strings): keep file order
        return df.reset_index(drop=True)


def _profiled(df: pd.DataFrame) -> pd.Series:
    """Which rows come from profiled points: their config says so, or their records carry profile fields."""
    flag = pd.Series(False, index=df.index)
    if "profile" in df.columns:
        flag |= df["profile"].map(lambda v: not _is_missing(v) and bool(v))
    fields = [c for c in df.columns if c.startswith("profile.")]
    if fields:
        flag |= df[fields].notna().any(axis=1)
    return flag


def _param_text(value: Any) -> str:
    """A method setting as `method_labels` compares and shows it: a column holding a null stores 128 as 128.0."""
    if _is_missing(value):
        return "null"
    if isinstance(value, (bool, np.bool_)):
        return str(bool(value)).lower()
    if isinstance(value, (float, np.floating)) and float(value).is_integer():
        return str(int(value))
    return str(value)


def _method_defaults(name: str) -> dict[str, str] | None:
    """The registered defaults of method `name` (a config name such as snapkv_head counts as its method), flattened
    and spelled as `method_labels` compares them; None for a method kvbench does not know."""
    from kvbench.config.paths import choice_name
    from kvbench.methods import METHODS  # torch: only once some method has variants to name

    cls = METHODS.get(name) or METHODS.get(choice_name("method", name))
    if cls is None:
        return None
    flat: dict[str, Any] = {}
    _flatten("", cls().params(), flat)  # built, not the dataclass fields: __post_init__ fills some in
    return {k: _param_text(v) for k, v in flat.items()}


def method_labels(df: pd.DataFrame, exclude: Sequence[str] = ()) -> pd.Series:
    """Each row's method, named by variant where one method has several among the rows.

    Points of one method that differ in its settings (records' ``method_params``) or in being profiled would
    otherwise read as the same row: such a variant is named by its settings that differ from the method's
    registered defaults, ``snapkv[block_size=128]``, and a profiled one gets ``+profile``. A method with one
    variant keeps its plain name. `exclude`: settings shown as columns of their own (a swept ``method.window``).
    """
    labels = df["method"].astype(object).copy()
    params = [c for c in df.columns if c.startswith("method_params.") and c.split(".", 1)[1] not in exclude]
    profiled = _profiled(df) if "profile" not in exclude else pd.Series(False, index=df.index)
    for method, rows in df.groupby("method", sort=False):
        used = [c for c in params if rows[c].notna().any()]  # the others are other methods' settings
        settings = rows[used].map(_param_text).rename(columns=lambda c: c.split(".", 1)[1])
        if len(settings.assign(_profiled=profiled[rows.index]).drop_duplicates()) < 2:
            continue
        defaults = _method_defaults(str(method))
        if defaults is None:  # unknown defaults: the settings that differ between its variants
            defaults = {n: "" for n in settings.columns if settings[n].nunique() > 1}
        for index, row in settings.iterrows():
            diff = [f"{n}={v}" for n, v in row.items() if n in defaults and defaults[n] != v]
            labels[index] = (f"{method}[{','.join(diff)}]" if diff else str(method)) + (
                "+profile" if profiled[index] else "")
    return labels


def point_table(df: pd.DataFrame) -> pd.DataFrame:
    """One row per point and subtask: n, mean score x100 with its 95% bootstrap interval (``ci_low``,
    ``ci_high``: `kvbench.results.stats`; empty where the interval needs more samples), the means of
    `TABLE_METRICS` present and the sums of `TABLE_TOTALS` present (after them: compile seconds beside
    ms/token).

    Points with several subtasks (suites) get an extra `TASK_MEAN_LABEL` row after their subtask rows: the
    unweighted mean of those rows (`mean_of_subtasks`, RULER's rule) with its interval stratified by subtask,
    n the total sample count and the totals summed. Variants of a method get their own names (`method_labels`).
    """
    if df.empty:
        return pd.DataFrame()
    keys = _point_keys(df)
    if "method" in df.columns:
        df = df.assign(method=method_labels(df))
    metrics = [m for m in TABLE_METRICS if m in df.columns]
    if SHARED_ROWS in df.columns and (pd.to_numeric(df[SHARED_ROWS], errors="coerce") > 1).any():
        metrics.append(SHARED_ROWS)  # only where something was shared: a table of lone points stays as it was
    totals = [m for m in TABLE_TOTALS if m in df.columns]
    agg: dict[str, tuple[str, Any]] = {"n": ("sample_id", "size"), "score": ("score", "mean")}
    agg.update({m: (m, "mean") for m in metrics})
    agg.update({m: (m, _total) for m in totals})
    numeric = df.assign(**{c: pd.to_numeric(df[c], errors="coerce") for c in ("score", *metrics, *totals)})
    numeric["_point"] = numeric.groupby(keys, dropna=False, sort=False).ngroup()
    grouped = numeric.groupby([*keys, "subtask"], dropna=False, sort=False)
    table = grouped.agg(**agg, _point=("_point", "first")).reset_index()
    table["score"] *= 100.0
    _add_interval(table, [_score_estimate(rows) for _, rows in grouped])
    table = _sorted(table, [*keys, "subtask"])

    records = dict(iter(numeric.groupby("_point", sort=False)))
    parts = []
    for _, rows in table.groupby(keys, dropna=False, sort=False):  # sort=False: keeps the sorted order
        parts.append(rows)
        if len(rows) > 1:
            mean = rows.iloc[[0]].copy()
            mean["subtask"] = TASK_MEAN_LABEL
            mean["n"] = rows["n"].sum()
            for col in ("score", *metrics):
                mean[col] = mean_of_subtasks(rows[col].dropna(), empty=math.nan)
            for col in totals:
                mean[col] = _total(rows[col])
            estimate = _score_estimate(records[rows["_point"].iloc[0]])
            mean[list(INTERVAL_COLUMNS)] = _bounds(estimate)
            parts.append(mean)
    out = pd.concat(parts, ignore_index=True).drop(columns="_point")
    out.attrs["point_columns"] = keys
    out.attrs["intervals"] = {"score": INTERVAL_COLUMNS}
    out.attrs["resampled"] = frame_resampled_unit(df)  # what the intervals resampled: samples, or problems
    return out


def _total(values: pd.Series) -> float:
    """The sum of a total's values, NaN where none was recorded (records from before the field)."""
    return float(values.sum(min_count=1))


# A score's 95% interval, beside it in a table's columns (`format_table` prints them in the score's cell).
INTERVAL_COLUMNS = ("ci_low", "ci_high")


def _score_estimate(records: pd.DataFrame) -> Estimate | None:
    """The score x100 of some records (one point's, of one subtask or all) with its stratified interval."""
    return frame_estimate(records.assign(score=records["score"] * 100.0))


def _bounds(estimate: Estimate | None) -> tuple[float, float]:
    """(low, high), NaN without an interval."""
    return (estimate.low, estimate.high) if estimate is not None and estimate.has_interval else (math.nan, math.nan)


def _add_interval(table: pd.DataFrame, estimates: Sequence[Estimate | None]) -> None:
    """`INTERVAL_COLUMNS` right after ``score``."""
    at = table.columns.get_loc("score") + 1
    bounds = [_bounds(e) for e in estimates]
    for offset, column in enumerate(INTERVAL_COLUMNS):
        table.insert(at + offset, column, [b[offset] for b in bounds])


def _is_missing(value: Any) -> bool:
    return value is None or value is pd.NA or (isinstance(value, float) and pd.isna(value))


def _label(value: Any) -> str:
    return "-" if _is_missing(value) else str(value)


def _index_of(frame: pd.DataFrame) -> pd.Index:
    """The rows of `frame` as an index shaped like `DataFrame.pivot`'s: flat for one column, else multi."""
    return pd.MultiIndex.from_frame(frame) if frame.shape[1] > 1 else pd.Index(frame.iloc[:, 0])


def pivot_scores(table: pd.DataFrame, columns: Sequence[str]) -> pd.DataFrame:
    """Scores of a `point_table` with `columns` (e.g. method, budget) spread across, one row per remaining
    identity and subtask: the usual method x budget comparison.

    The point hash is dropped from the row identity (it differs across the spread columns by construction),
    so two points that agree on every shown field would collide; that is an error, not an average.
    """
    missing = [c for c in columns if c not in table.columns]
    if missing:
        raise ValueError(f"cannot pivot on {missing}; columns are {list(table.columns)}")
    index = [k for k in _point_keys(table) if k not in columns and k != "point_hash"] + ["subtask"]
    index = [k for k in index if k in table.columns]
    if table.duplicated([*index, *columns]).any():
        raise ValueError("points differ only in fields not shown (seed? engine settings?); pivot would merge "
                         "them; report without --pivot to see their point_hash")
    bounds = [c for c in INTERVAL_COLUMNS if c in table.columns]
    companions = [*bounds, *(["n"] if "n" in table.columns else [])]
    spread = []
    for values in ("score", *companions):
        part = table.pivot(index=index, columns=list(columns), values=values)
        # pivot sorts as strings; instead sort rows by identity keeping each point's subtask order (suite mean
        # row last), and columns by identity (budgets numerically within each method).
        part = part.reindex(index=_index_of(_sorted(table[index].drop_duplicates(), index[:-1])),
                            columns=_index_of(_sorted(table[list(columns)].drop_duplicates(), list(columns))))
        part.columns = ["/".join(_label(v) for v in (c if isinstance(c, tuple) else (c,))) for c in part.columns]
        spread.append(part)
    scores = list(spread[0].columns)
    for values, part in zip(companions, spread[1:]):  # each score's interval and n beside it, named after it
        part.columns = [f"{c} {values}" for c in part.columns]
    wide = pd.concat(spread, axis=1).reset_index()
    wide.attrs["score_columns"] = scores
    wide.attrs["resampled"] = table.attrs.get("resampled", "samples")
    if len(bounds) == len(INTERVAL_COLUMNS):
        wide.attrs["intervals"] = {c: tuple(f"{c} {b}" for b in INTERVAL_COLUMNS) for c in scores}
    if "n" in companions:
        wide.attrs["counts"] = {c: f"{c} n" for c in scores}
    return wide


def _format_cell(column: str, value: Any, score_columns: set[str]) -> str:
    if _is_missing(value):
        return "-"
    if column in score_columns:
        return f"{value:.1f}"
    if column == "nll":
        return f"{value:.3f}"
    if column in ("decode_ms_per_token", "ms/token"):
        return f"{value:.2f}"
    if column in ("decode_compile_s", "compile s"):
        return f"{value:.1f}"
    if column == "kv_bytes_after_prefill":
        return f"{value / 2**20:.1f} MiB"
    if column == "KV MiB":
        return f"{value:.1f}"
    if column in (SHARED_ROWS, "rows/step"):
        return f"{value:.3g}"  # 5, or 4.5 where some samples' rows decoded alone
    if column in ("kept_tokens_mean", "kept"):
        return f"{value:.6g}"
    if column == "budget" and isinstance(value, float) and value.is_integer() and value >= 2:
        return str(int(value))  # a token count beside full's missing budget (pandas made it 128.0)
    return str(value)


def format_table(table: pd.DataFrame, markdown: bool = False) -> str:
    """Render a table for a terminal (fixed width) or a paper draft (markdown, no `tabulate` needed).

    Scores (including the columns of `pivot_scores`) show one decimal, with their 95% interval where the
    table carries one (``attrs["intervals"]``: score column -> its low and high columns, printed in the
    score's cell as `48.9 [37.8, 60.0]`) and, in a pivot, its sample count (``attrs["counts"]``: `n=9`); NLL
    three decimals, KV bytes as MiB; identity fields such as budgets are shown as stored (a budget of 1.0 is
    not shown as 1 tokens); missing values as "-".
    """
    if table.empty:
        return "(no records)"
    score_columns = {"score", *table.attrs.get("score_columns", [])}
    intervals = {c: pair for c, pair in table.attrs.get("intervals", {}).items()
                 if c in table.columns and all(b in table.columns for b in pair)}
    counts = {c: n for c, n in table.attrs.get("counts", {}).items() if c in table.columns and n in table.columns}
    hidden = {b for pair in intervals.values() for b in pair} | set(counts.values())
    shown = [c for c in table.columns if c not in hidden]
    cells = pd.DataFrame({c: [_format_cell(str(c), v, score_columns) for v in table[c]] for c in shown})
    for column, (low, high) in intervals.items():
        cells[column] = [text if _is_missing(lo) or _is_missing(hi) else f"{text} [{lo:.1f}, {hi:.1f}]"
                         for text, lo, hi in zip(cells[column], table[low], table[high])]
    for column, n in counts.items():
        cells[column] = [text if _is_missing(k) else f"{text} n={int(k)}" for text, k in zip(cells[column], table[n])]
    if not markdown:
        return cells.to_string(index=False)
    numeric = [pd.api.types.is_numeric_dtype(table[c]) and not pd.api.types.is_bool_dtype(table[c])
               for c in shown]
    lines = ["| " + " | ".join(map(str, shown)) + " |",
             "|" + "|".join("---:" if num else "---" for num in numeric) + "|"]
    lines += ["| " + " | ".join(v.replace("|", "\\|") for v in row) + " |" for row in cells.itertuples(index=False)]
    return "\n".join(lines)


def interval_legend(unit: str = "samples") -> str:
    """Under a printed table whose scores carry intervals: what the brackets are; `unit`: what the intervals
    resampled (`kvbench.results.stats.resampled_unit`: samples, or a task's problems with their sampled
    responses)."""
    return (f"score x100 [95% bootstrap interval over {unit}, stratified by subtask]; no brackets: fewer "
            f"than 2 {'samples' if unit == 'samples' else 'samples or problems'} in a subtask")


INTERVAL_LEGEND = interval_legend()  # the legend of a table over samples


def compact(table: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """The columns of a `point_table` (or its `pivot_scores`) worth printing, and a line naming the rest.

    Shown: `ALWAYS_SHOWN` (measurements missing everywhere left out, and totals zero everywhere: compile
    seconds of an eager sweep) and every other column that differs between rows; the point hash only where rows
    would otherwise read alike. The constant columns go into the line ("model m, task t, dtype float32, seed
    42"); a subtask equal to its task is not repeated there.
    """
    full, scores = table, set(table.attrs.get("score_columns", []))
    intervals, counts = table.attrs.get("intervals", {}), table.attrs.get("counts", {})
    # printed in their score's cell (`format_table`), not as columns of their own
    companions = [b for pair in intervals.values() for b in pair] + list(counts.values())
    table = table.drop(columns=[b for b in companions if b in table.columns])
    same_n = full[[n for n in counts.values() if n in full.columns]].stack().dropna().unique()
    if len(same_n) == 1:  # one sample count in every cell: said once in the note
        table = table.assign(n=int(same_n[0]))
        counts = {}
    texts = {c: table[c].map(_label) for c in table.columns}
    varying = {c for c in table.columns if texts[c].nunique() > 1}
    measured = ("score", *TABLE_METRICS, *TABLE_TOTALS, SHARED_ROWS)
    unmeasured = {c for c in measured if c in table.columns and (
        table[c].isna().all() or c in TABLE_TOTALS and not table[c].fillna(0).astype(bool).any())}
    shown = {c for c in table.columns if c != "point_hash" and c not in unmeasured and (
        c in scores or c in varying or c in ALWAYS_SHOWN or c == SHARED_ROWS)}
    identity = [c for c in table.columns if c in shown and c not in (*scores, *measured, "n")]
    if "point_hash" in varying and identity and table.duplicated(identity).any():
        shown.add("point_hash")  # points that differ only in settings not shown: their hashes tell them apart
    constant = [c for c in table.columns if c not in shown and c not in varying and c != "point_hash"
                and c not in unmeasured and not table[c].isna().all()]
    note = ", ".join(f"{c} {texts[c].iloc[0]}" for c in constant if not (
        c == "subtask" and "task" in table and texts[c].iloc[0] == texts["task"].iloc[0]))
    shown = [c for c in table.columns if c in shown]
    out = table[shown].copy()
    kept = {c: pair for c, pair in intervals.items() if c in out.columns}
    for pair in kept.values():
        out[list(pair)] = full[list(pair)]
    counts = {c: n for c, n in counts.items() if c in out.columns}
    for n in counts.values():
        out[n] = full[n]
    if "kv_bytes_after_prefill" in out:
        out["kv_bytes_after_prefill"] = out["kv_bytes_after_prefill"] / 2**20
    out = out.rename(columns=DISPLAY_NAMES)
    out.attrs["score_columns"] = list(scores)
    out.attrs["intervals"] = kept
    out.attrs["counts"] = counts
    out.attrs["resampled"] = full.attrs.get("resampled", "samples")
    return out, note


def points_text(table: pd.DataFrame, markdown: bool = False, pivot: Sequence[str] | None = None) -> str:
    """A `point_table` as printed: its score pivot when `pivot` is given, then `compact`. Raises ValueError
    for a pivot that cannot be made (see `pivot_scores`)."""
    if table.empty:
        return format_table(table)
    shown, note = compact(pivot_scores(table, pivot) if pivot else table)
    text = format_table(shown, markdown=markdown)
    if any(shown[b].notna().any() for pair in shown.attrs["intervals"].values() for b in pair):
        text += ("\n\n" if markdown else "\n") + interval_legend(shown.attrs.get("resampled", "samples"))
    if DISPLAY_NAMES[SHARED_ROWS] in shown and "ms/token" in shown:
        text += ("\n\n" if markdown else "\n") + SHARED_ROWS_LEGEND
    return f"{note}\n\n{text}" if note and markdown else f"{note}\n{text}" if note else text


def report_text(results_root: Path, markdown: bool = False, pivot: Sequence[str] | None = None,
                run_dirs: list[Path] | None = None) -> str:
    """The rendered report of a results tree: point table, or its score pivot. `run_dirs`: only these point
    directories (a sweep's own points in a results tree it shares with others)."""
    df = collect(results_root)
    if run_dirs is not None and not df.empty:
        attrs = dict(df.attrs)
        wanted = {Path(d).resolve() for d in run_dirs}
        df = df[[(Path(results_root) / d).resolve() in wanted for d in df["run_dir"]]]
        df.attrs.update(attrs)
    return points_text(point_table(df), markdown=markdown, pivot=pivot)


def _split(fields: str) -> list[str]:
    return [f.strip() for f in fields.split(",") if f.strip()]
