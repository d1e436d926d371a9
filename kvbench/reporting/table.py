"""Aggregate the records of many run directories into tables, from the command line or after a Hydra sweep.

Everything is recomputed from ``records.jsonl`` files (never from ``summary.json``), so a report is correct
for partially finished, resumed or re-scored points, and reading never modifies a run directory: reports
may run while a sweep is still writing.

    kvbench report experiment=NAME | RESULTS_DIR [--out DIR] [--publish] [--csv FILE] [--markdown] [--pivot a,b]

prints the point table and writes the paper's layout (kvbench/reporting/paper.py) under <results_dir>/report/.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from kvbench.results.collect import POINT_FIELDS, collect
from kvbench.results.summary import mean_of_subtasks

log = logging.getLogger(__name__)


# Per-(point, subtask) means reported by `point_table`, when the records have them.
TABLE_METRICS = ("nll", "decode_ms_per_token", "kv_bytes_after_prefill")


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


def point_table(df: pd.DataFrame) -> pd.DataFrame:
    """One row per point and subtask: n, mean score x100, and the means of `TABLE_METRICS` present.

    Points with several subtasks (suites) get an extra `TASK_MEAN_LABEL` row after their subtask rows: the
    unweighted mean of those rows (`mean_of_subtasks`, RULER's rule), with n the total sample count.
    """
    if df.empty:
        return pd.DataFrame()
    keys = _point_keys(df)
    metrics = [m for m in TABLE_METRICS if m in df.columns]
    agg: dict[str, tuple[str, str]] = {"n": ("sample_id", "size"), "score": ("score", "mean")}
    agg.update({m: (m, "mean") for m in metrics})
    numeric = df.assign(**{c: pd.to_numeric(df[c], errors="coerce") for c in ("score", *metrics)})
    table = numeric.groupby([*keys, "subtask"], dropna=False, sort=False).agg(**agg).reset_index()
    table["score"] *= 100.0
    table = _sorted(table, [*keys, "subtask"])

    parts = []
    for _, rows in table.groupby(keys, dropna=False, sort=False):  # sort=False: keeps the sorted order
        parts.append(rows)
        if len(rows) > 1:
            mean = rows.iloc[[0]].copy()
            mean["subtask"] = TASK_MEAN_LABEL
            mean["n"] = rows["n"].sum()
            for col in ("score", *metrics):
                mean[col] = mean_of_subtasks(rows[col].dropna(), empty=math.nan)
            parts.append(mean)
    out = pd.concat(parts, ignore_index=True)
    out.attrs["point_columns"] = keys
    return out


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
    wide = table.pivot(index=index, columns=list(columns), values="score")
    # pivot sorts as strings; instead sort rows by identity keeping each point's subtask order (suite mean
    # row last), and columns by identity (budgets numerically within each method).
    wide = wide.reindex(index=_index_of(_sorted(table[index].drop_duplicates(), index[:-1])),
                        columns=_index_of(_sorted(table[list(columns)].drop_duplicates(), list(columns))))
    wide.columns = ["/".join(_label(v) for v in (c if isinstance(c, tuple) else (c,))) for c in wide.columns]
    wide = wide.reset_index()
    wide.attrs["score_columns"] = [c for c in wide.columns if c not in index]
    return wide


def _format_cell(column: str, value: Any, score_columns: set[str]) -> str:
    if _is_missing(value):
        return "-"
    if column in score_columns:
        return f"{value:.1f}"
    if column == "nll":
        return f"{value:.3f}"
    if column == "decode_ms_per_token":
        return f"{value:.2f}"
    if column == "kv_bytes_after_prefill":
        return f"{value / 2**20:.1f} MiB"
    return str(value)


def format_table(table: pd.DataFrame, markdown: bool = False) -> str:
    """Render a table for a terminal (fixed width) or a paper draft (markdown, no `tabulate` needed).

    Scores (including the columns of `pivot_scores`) show one decimal, NLL three, KV bytes as MiB; identity
    fields such as budgets are shown as stored (a budget of 1.0 is not shown as 1 tokens); missing values
    as "-".
    """
    if table.empty:
        return "(no records)"
    score_columns = {"score", *table.attrs.get("score_columns", [])}
    cells = pd.DataFrame({c: [_format_cell(str(c), v, score_columns) for v in table[c]] for c in table.columns})
    if not markdown:
        return cells.to_string(index=False)
    numeric = [pd.api.types.is_numeric_dtype(table[c]) and not pd.api.types.is_bool_dtype(table[c])
               for c in table.columns]
    lines = ["| " + " | ".join(map(str, table.columns)) + " |",
             "|" + "|".join("---:" if num else "---" for num in numeric) + "|"]
    lines += ["| " + " | ".join(v.replace("|", "\\|") for v in row) + " |" for row in cells.itertuples(index=False)]
    return "\n".join(lines)


def report_text(results_root: Path, markdown: bool = False, pivot: Sequence[str] | None = None) -> str:
    """The rendered report of a results tree: point table, or its score pivot."""
    table = point_table(collect(results_root))
    return format_table(pivot_scores(table, pivot) if pivot and not table.empty else table, markdown=markdown)


def _split(fields: str) -> list[str]:
    return [f.strip() for f in fields.split(",") if f.strip()]
