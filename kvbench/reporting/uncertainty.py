"""What a paper table's numbers can carry: each cell's sample count and 95% interval, the paired comparisons of
each series with the reference of its row group (and the preset's own, `report.compare`), and the difference
the records can detect. Every number comes from `kvbench.results.stats` over the records behind the cell
(`main_table`'s ``attrs["cells"]``); the table's own values are left as they are.

A delta table (CTKVR's differences from Full KV) gives each difference the interval of its paired comparison.
Two cells are paired over the samples both points ran (subtask, sample id and content digest): rows never
pair across models, tasks, lengths or dtypes (they are row fields, so their own groups), and points without a
shared sample are named, not paired.
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from kvbench.reporting.paper_tables import MISSING, ReportSpec
from kvbench.reporting.preset_points import norm
from kvbench.results.stats import (
    Detectable,
    Estimate,
    detectable_difference,
    frame_estimate,
    paired_differences,
    paired_estimate,
)

Cell = tuple[tuple, str]  # (row identity, column)


# A comparison's outcome, as the comparisons table says it.
DISTINGUISHABLE = "distinguishable"
NOT_DISTINGUISHABLE = "not distinguishable"
NO_INTERVAL = "no interval (a subtask with fewer than 2 shared samples)"
NOT_PAIRED = "not paired: no shared samples"


class CellRecords:
    """The records behind each cell of a table, in score points (x100)."""

    def __init__(self, table: pd.DataFrame, records: pd.DataFrame, key: str) -> None:
        self.sources: Mapping[Cell, tuple[Any, dict[str, float] | None]] = table.attrs.get("cells", {})
        scored = records.assign(score=pd.to_numeric(records["score"], errors="coerce") * 100.0)
        self.by_point = dict(iter(scored.groupby(key, sort=False))) if len(scored) else {}

    def of(self, cell: Cell) -> tuple[pd.DataFrame, dict[str, float] | None] | None:
        """The cell's records (only its subtasks) and their weights; None for a cell without records."""
        source = self.sources.get(cell)
        if source is None or source[0] not in self.by_point:
            return None
        point, weights = source
        rows = self.by_point[point]
        if weights is not None:
            rows = rows[rows["subtask"].astype(str).isin(list(weights))]
        return rows, weights


def _counterpart(row: tuple, rows: Sequence[str], spec: ReportSpec, series: str, rids: set[tuple]) -> tuple | None:
    """The row of `series` in `row`'s group: the same fields but the series, or, for a series without a budget
    (the full cache), also any budget."""
    at = rows.index(spec.series)
    same = row[:at] + (norm(series),) + row[at + 1:]
    if same in rids:
        return same
    if "budget" in rows:
        b = rows.index("budget")
        unbudgeted = tuple("-" if i == b else v for i, v in enumerate(same))
        if unbudgeted in rids:
            return unbudgeted
    return None


def _pairs(table: pd.DataFrame, spec: ReportSpec) -> list[tuple[tuple, tuple, str]]:
    """(row, counterpart row, against) for every series row against the reference, then the preset's own
    comparisons (`report.compare`), each against the row of its group."""
    rows = table.attrs["row_fields"]
    rids = [tuple(r) for r in table[rows].itertuples(index=False)]
    known = set(rids)
    at = rows.index(spec.series)
    out = []
    wanted = [(None, spec.reference)] + [(norm(a), b) for a, b in spec.compare]
    for series, against in wanted:
        for rid in rids:
            if rid[at] == norm(against) or (series is not None and rid[at] != series):
                continue
            other = _counterpart(rid, rows, spec, against, known)
            if other is not None:
                out.append((rid, other, against))
    return out


def cell_intervals(table: pd.DataFrame, spec: ReportSpec, cells: CellRecords) -> dict[Cell, Estimate]:
    """Each valued cell's estimate: its records' score and interval, or in a delta table, for the rows that
    hold differences, the paired difference from the reference's cell."""
    out: dict[Cell, Estimate] = {}
    for cell in cells.sources:
        found = cells.of(cell)
        if found is not None:
            estimate = frame_estimate(found[0], weights=found[1])
            if estimate is not None:
                out[cell] = estimate
    if spec.delta:
        for rid, other, against in _pairs(table, spec):
            if against != spec.reference:
                continue
            for column in table.attrs["value_columns"]:
                paired = _paired(cells, (rid, column), (other, column))
                if paired is not None:
                    out[(rid, column)] = paired[0] if paired[0] is not None else Estimate(float("nan"), 0)
    return out


def _paired(cells: CellRecords, mine: Cell, theirs: Cell) -> tuple[Estimate | None, pd.DataFrame] | None:
    """The paired estimate of two cells and their paired differences; None when either has no records."""
    a, b = cells.of(mine), cells.of(theirs)
    if a is None or b is None:
        return None
    return paired_estimate(a[0], b[0], weights=a[1]), paired_differences(a[0], b[0])


def comparisons(table: pd.DataFrame, spec: ReportSpec, cells: CellRecords,
                headline: Sequence[str]) -> tuple[pd.DataFrame, Detectable | None]:
    """Every paired comparison of the table (one row per row pair and column) and what the headline columns'
    comparisons can detect (`detectable_difference`, goal 5 points)."""
    rows = table.attrs["row_fields"]
    axis = spec.x if spec.columns == "budget" else spec.columns
    group = [f for f in rows if f != spec.series]
    records, planned = [], []
    for rid, other, against in _pairs(table, spec):
        for column in table.attrs["value_columns"]:
            paired = _paired(cells, (rid, column), (other, column))
            if paired is None:
                continue
            estimate, differences = paired
            row = {**{f: v for f, v in zip(rows, rid) if f in group}, axis: column, spec.series: rid[rows.index(
                spec.series)], "against": norm(against), "n_shared": 0 if estimate is None else estimate.n}
            if estimate is None:
                row.update(difference=None, ci_low=None, ci_high=None, result=NOT_PAIRED)
            else:
                row.update(difference=estimate.value, ci_low=estimate.low, ci_high=estimate.high,
                           result=NO_INTERVAL if not estimate.has_interval else DISTINGUISHABLE
                           if estimate.excludes_zero else NOT_DISTINGUISHABLE)
                if column in headline:
                    weights = cells.of((rid, column))[1]
                    clusters = differences["cluster"].astype(str).tolist() if "cluster" in differences else None
                    planned.append((differences["diff"].to_numpy(), differences["subtask"].astype(str).to_numpy(),
                                    weights, clusters))
            records.append(row)
    columns = [*group, axis, spec.series, "against", "n_shared", "difference", "ci_low", "ci_high", "result"]
    return pd.DataFrame(records, columns=columns), detectable_difference(planned)


def with_interval_columns(table: pd.DataFrame, estimates: Mapping[Cell, Estimate]) -> pd.DataFrame:
    """The table as the CSV holds it: its layout, then for every value column its `n`, `ci_low`, `ci_high`."""
    rows = table.attrs["row_fields"]
    out = table.copy()
    rids = [tuple(r) for r in table[rows].itertuples(index=False)]
    for column in table.attrs["value_columns"]:
        found = [estimates.get((rid, column)) for rid in rids]
        out[f"{column} n"] = pd.array([e.n if e is not None else None for e in found], dtype="Int64")
        out[f"{column} ci_low"] = [e.low if e is not None else None for e in found]
        out[f"{column} ci_high"] = [e.high if e is not None else None for e in found]
    return out


def interval_table(table: pd.DataFrame, estimates: Mapping[Cell, Estimate], digits: int = 1) -> pd.DataFrame:
    """The table's layout with each cell's interval as text, `[37.8, 60.0] n=9` (`n=1`: no interval), missing
    cells as they are."""
    rows = table.attrs["row_fields"]
    out = table[rows].copy()
    rids = [tuple(r) for r in table[rows].itertuples(index=False)]
    for column in table.attrs["value_columns"]:
        texts = []
        for rid, value in zip(rids, table[column]):
            e = estimates.get((rid, column))
            texts.append((f"{e.interval_text(digits)} n={e.n}" if e.has_interval else f"n={e.n}") if e is not None else (
                value if isinstance(value, str) else "-"))
        out[column] = texts
    return out


def hover_titles(table: pd.DataFrame, estimates: Mapping[Cell, Estimate]) -> dict[tuple[int, str], str]:
    """{(row position, column): "95% CI [37.8, 60.0], n=9"} for the HTML table's cells."""
    rows = table.attrs["row_fields"]
    out = {}
    for i, rid in enumerate(tuple(r) for r in table[rows].itertuples(index=False)):
        for column in table.attrs["value_columns"]:
            e = estimates.get((rid, column))
            if e is not None:
                interval = f"95% CI {e.interval_text()}" if e.has_interval else "no interval (fewer than 2 samples)"
                out[(i, column)] = f"{interval}, n={e.n}"
    return out


def detectable_text(found: Detectable | None, name: str, unit: str = "samples") -> str:
    """One sentence for a report: what these records can detect, and what would detect the goal. `unit`: what
    the intervals resampled (`kvbench.results.stats.resampled_unit`); sampled responses to one problem are one
    sample here too, the mean of their differences."""
    if found is None:
        return (f"{name}: no detectable difference can be estimated (no paired comparison with two or more "
                f"shared samples in every subtask and any variation).")
    per, whole = "samples", ""
    if unit != "samples":
        per = "problems" if "elsewhere" not in unit else "samples"
        whole = ", a problem's sampled responses as one sample, the mean of their differences"
    return (f"{name}: with these records (median {found.samples_per_subtask:g} {per} per subtask, "
            f"{found.comparisons} paired comparison{'s' if found.comparisons > 1 else ''} of the headline score), "
            f"a paired difference of "
            f"{found.difference:.1f} points is detectable (two-sided 5% test, 80% power, from the observed "
            f"variance of the paired differences{whole}); task.num_samples={found.samples_for_goal} per subtask "
            f"would detect {found.goal:g} points.")


def html_table(shown: pd.DataFrame, titles: Mapping[tuple[int, str], str]) -> str:
    """`shown` as an HTML table whose value cells carry `titles` on hover (and a dotted underline)."""
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in shown.columns)
    body = []
    for i, row in enumerate(shown.itertuples(index=False)):
        cells = []
        for column, value in zip(shown.columns, row):
            title = titles.get((i, column))
            text = html.escape(str(value))
            cells.append(f"<td title='{html.escape(title)}' style='text-decoration:underline dotted'>{text}</td>"
                         if title and value != MISSING else f"<td>{text}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"
