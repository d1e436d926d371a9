"""The papers' figures drawn from point tables: accuracy vs budget, NIAH heatmaps, kept tokens, efficiency and
storage/traffic (matplotlib, files only)."""

from __future__ import annotations

from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.transforms import offset_copy

from kvbench.reporting.efficiency import spread_bars
from kvbench.reporting.paper_tables import (
    MISSING,
    ReportSpec,
    Source,
    _norm_frame,
    _row_fields,
    _sort_key,
    _varying,
    missing_points,
)
from kvbench.reporting.preset_points import norm


def _grid_axes(n: int, width: float = 4.6, height: float = 3.6, **kwargs: Any) -> tuple[plt.Figure, list[plt.Axes]]:
    cols = min(3, max(1, n))
    nrows = -(-n // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(max(2 * width, width * cols), height * nrows + 0.9),
                             squeeze=False, **kwargs)
    flat = list(axes.ravel())
    for ax in flat[n:]:
        ax.set_visible(False)
    return fig, flat[:n]


def _panels(source: Source, points: pd.DataFrame) -> tuple[list[str], list[tuple], pd.DataFrame]:
    """The fields that split an accuracy figure into panels, each panel's values, and each point's values."""
    spec = source.spec
    panel_fields = [f for f in spec.panels if f in _varying(points, source.grid, spec.panels)]
    others = [f for f in _row_fields(spec, points, source.grid) if f not in (*panel_fields, spec.series, spec.x)]
    panel_fields += others  # any other varying field gets its own panels rather than merged lines
    ident = _norm_frame(points, panel_fields)
    panel_ids = sorted({tuple(r) for r in ident.itertuples(index=False)}
                       | {tuple(p.get(f, "-") for f in panel_fields) for p in source.grid or []},
                       key=lambda r: tuple(map(_sort_key, r)))
    return panel_fields, panel_ids, ident


def equal_traffic_figure(source: Source, points: pd.DataFrame) -> plt.Figure | None:
    """Score vs the K/V tokens each point's decode steps read per KV group and step (measured, estimates and
    page bounds included): the papers' budget axes count differently (RocketKV's t includes the estimate,
    CTKVR's and Quest's budget is the tokens attended), so this is the equal-traffic comparison. Drawn when a
    sparse or retrieval method is among the series."""
    spec = source.spec
    if "read_tokens" not in points.columns or not points["family"].isin(["selection", "two-stage"]).any():
        return None
    drawn = points[(points[spec.series] != spec.reference) & points["read_tokens"].notna()]
    if drawn.empty:
        return None
    panel_fields, panel_ids, ident = _panels(source, points)
    fig, axes = _grid_axes(len(panel_ids))
    series_values = sorted({norm(v) for v in drawn[spec.series]})
    for ax, pid in zip(axes, panel_ids):
        mask = (ident == list(pid)).all(axis=1) if panel_fields else pd.Series(True, index=points.index)
        here = points[mask]
        for i, series in enumerate(series_values):
            line = drawn[mask.reindex(drawn.index)]
            line = line[line[spec.series].map(norm) == series].sort_values("read_tokens")
            if len(line):
                ax.plot(line["read_tokens"], line["score"], color=plt.cm.tab10(i % 10), label=series,
                        marker="osD^vPX*"[i % 8], linestyle=("-", "--", "-.", ":")[i % 4])
                _error_bars(ax, line["read_tokens"], line, plt.cm.tab10(i % 10))
        ref = here[here[spec.series] == spec.reference]
        if len(ref):
            _reference_line(ax, ref, spec.reference)
        if drawn["read_tokens"].min() > 0:
            ax.set_xscale("log", base=2)
        _label_panel(ax, "K/V tokens read per KV group and step", panel_fields, pid, spec)
    return _finish(fig, axes, f"{spec.title}: at equal traffic (measured reads, not the budget)")


def _error_bars(ax: plt.Axes, xs: pd.Series, points: pd.DataFrame, color: Any, **kwargs: Any) -> None:
    """Each point's 95% interval as an error bar; a point without one (too few samples) gets none, not a
    zero-length bar."""
    if "ci_low" not in points.columns:
        return
    has = points["ci_low"].notna() & points["ci_high"].notna()
    if has.any():
        y = points.loc[has, "score"].astype(float)
        ax.errorbar(xs[has].astype(float), y, yerr=[y - points.loc[has, "ci_low"], points.loc[has, "ci_high"] - y],
                    fmt="none", ecolor=color, elinewidth=1, capsize=3, alpha=0.8, **kwargs)


def _reference_line(ax: plt.Axes, ref: pd.DataFrame, label: str) -> None:
    """The reference's score as a dashed line, its 95% interval as a grey band."""
    ax.axhline(float(ref["score"].mean()), color="black", linestyle="--", linewidth=1, label=label)
    if len(ref) == 1 and "ci_low" in ref.columns and pd.notna(ref["ci_low"].iloc[0]):
        ax.axhspan(float(ref["ci_low"].iloc[0]), float(ref["ci_high"].iloc[0]), color="grey", alpha=0.15, linewidth=0)


def _label_panel(ax: plt.Axes, xlabel: str, panel_fields: list[str], pid: tuple, spec: ReportSpec) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel("score")
    ax.set_title(", ".join(f"{f}={v}" for f, v in zip(panel_fields, pid)) or spec.title, fontsize=9)
    ax.grid(alpha=0.3)


def _finish(fig: plt.Figure, axes: list[plt.Axes], title: str) -> plt.Figure:
    """One legend for every panel's lines, under them, and the figure's title."""
    handles = {label: h for ax in axes for h, label in zip(*ax.get_legend_handles_labels())}
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=min(6, len(handles)), fontsize=8,
               frameon=False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.08, 1, 0.96))
    return fig


def accuracy_figure(source: Source, points: pd.DataFrame) -> plt.Figure | None:
    """Score vs x, one panel per combination of the spec's panel fields, one line per series value with each
    point's 95% interval as an error bar; the reference as a dashed line in a grey band (its interval); an
    expected point without records is a gap with a "missing" mark."""
    spec = source.spec
    x = spec.x
    if x not in points.columns:
        return None
    compressed = points[points[spec.series] != spec.reference]
    if compressed.empty or compressed[x].map(norm).nunique() < 2 and not source.grid:
        return None
    panel_fields, panel_ids, ident = _panels(source, points)
    missing = missing_points(points, source.grid)
    fig, axes = _grid_axes(len(panel_ids))
    series_values = sorted({norm(v) for v in compressed[spec.series]}
                           | {p[spec.series] for p in source.grid or [] if p.get(spec.series) != spec.reference})
    colors = {s: plt.cm.tab10(i % 10) for i, s in enumerate(series_values)}
    # equal scores draw on top of each other: each series gets its own marker, dash and a size that shrinks
    # down the list, so a line hidden under another still shows its markers
    styles = {s: {"marker": "osD^vPX*"[i % 8], "linestyle": ("-", "--", "-.", ":")[i % 4],
                  "markersize": max(3.0, 9.0 - 1.0 * i)} for i, s in enumerate(series_values)}
    xs_all = sorted({norm(v) for v in compressed[x]} | {p.get(x, "-") for p in source.grid or []} - {"-"},
                    key=_sort_key)
    numeric_x = [float(v) for v in xs_all if _sort_key(v)[0] == 0]
    categorical = len(numeric_x) < len(xs_all)  # a setting's names (CTKVR's centroid rules): evenly spaced, in order
    place = {v: float(i) if categorical else float(v) for i, v in enumerate(xs_all)}
    log_x = not categorical and bool(numeric_x) and min(numeric_x) >= 1
    for ax, pid in zip(axes, panel_ids):
        mask = (ident == list(pid)).all(axis=1) if panel_fields else pd.Series(True, index=points.index)
        here = points[mask]
        for i, series in enumerate(series_values):
            line = here[here[spec.series].map(norm) == series]
            by_x = {norm(v): s for v, s in zip(line[x], line["score"])}
            ys = [by_x.get(v, np.nan) for v in xs_all]
            xv = [place[v] for v in xs_all]
            # each series a few points aside, so error bars at one x do not cover each other
            dodged = offset_copy(ax.transData, fig=fig, x=3.0 * (i - (len(series_values) - 1) / 2), units="points")
            ax.plot(xv, ys, color=colors[series], label=series, transform=dodged, **styles[series])
            _error_bars(ax, line[x].map(norm).map(place), line, colors[series], transform=dodged)
            # a shifted transform keeps its artists out of autoscaling: the limits from the data themselves
            bounds = [c for c in ("score", "ci_low", "ci_high") if c in line.columns]
            ax.update_datalim([(place[norm(v)], float(y)) for v, row in zip(line[x], line[bounds].values)
                               for y in row if pd.notna(y)])
            for v in xs_all:
                gone = any(p.get(spec.series) == series and p.get(x) == v
                           and all(p.get(f, "-") == i for f, i in zip(panel_fields, pid)) for p in missing)
                if gone:
                    ax.plot([place[v]], [0.02], marker="x", color=colors[series], transform=ax.get_xaxis_transform(),
                            clip_on=False)
        ref = here[here[spec.series] == spec.reference]
        if len(ref):
            _reference_line(ax, ref, spec.reference)
        elif any(p.get(spec.series) == spec.reference and all(p.get(f, "-") == i for f, i in zip(panel_fields, pid))
                 for p in missing):
            ax.text(0.02, 0.96, f"{spec.reference}: {MISSING}", transform=ax.transAxes, va="top", fontsize=8)
        ax.autoscale_view()
        if log_x:
            ax.set_xscale("log", base=2)
            ax.set_xticks(numeric_x, [f"{v:g}" for v in numeric_x])
            ax.minorticks_off()
        elif categorical:
            ax.set_xticks(list(place.values()), xs_all)
        _label_panel(ax, x, panel_fields, pid, spec)
    return _finish(fig, axes, spec.title + (f"  (x: {MISSING} point)" if missing else ""))


def niah_heatmap_figure(df: pd.DataFrame, spec: ReportSpec) -> plt.Figure | None:
    """NIAH: mean score per (depth, length) cell, one heatmap per point."""
    if not {"meta.depth", "meta.length"} <= set(df.columns):
        return None
    niah = df[df["meta.depth"].notna() & df["meta.length"].notna()].copy()
    if niah.empty:
        return None
    niah["score"] = pd.to_numeric(niah["score"], errors="coerce") * 100
    niah["budget_label"] = niah["budget"].map(norm)
    niah["dtype_label"] = niah["dtype"].map(norm) if "dtype" in niah else "-"  # a cell never mixes two dtypes
    groups = sorted(niah.groupby(["model", "method", "budget_label", "dtype_label"], sort=False),
                    key=lambda g: (g[0][0], g[0][1] != spec.reference, g[0][1], _sort_key(g[0][2]), g[0][3]))[:24]
    several_dtypes = niah["dtype_label"].nunique() > 1
    fig, axes = _grid_axes(len(groups), width=4.2, height=3.4, layout="constrained")
    image = None
    for ax, ((model, method, budget, dtype), rows) in zip(axes, groups):
        grid = rows.pivot_table(index="meta.depth", columns="meta.length", values="score", aggfunc="mean")
        image = ax.imshow(grid.values, vmin=0, vmax=100, cmap="RdYlGn", aspect="auto", origin="upper")
        ax.set_xticks(range(len(grid.columns)), [f"{c:g}" for c in grid.columns], fontsize=7, rotation=45)
        ax.set_yticks(range(len(grid.index)), [f"{d:g}" for d in grid.index], fontsize=7)
        ax.set_xlabel("context length")
        ax.set_ylabel("needle depth (%)")
        ax.set_title(f"{method} @ {budget} ({model}{', ' + dtype if several_dtypes else ''})", fontsize=9)
    if image is not None:
        fig.colorbar(image, ax=axes, shrink=0.8, label="score")
    fig.suptitle(f"{spec.title}: needle-in-a-haystack", fontsize=10)
    return fig


def kept_tokens_figure(df: pd.DataFrame, spec: ReportSpec) -> plt.Figure | None:
    """Per-head kept tokens after prefill, for points whose heads keep different numbers (head-wise budgets)."""
    if "kept_tokens_per_head" not in df.columns:
        return None
    import json

    dists = {}
    # one box per method, budget, and model and dtype where they differ: heads of two models are not one sample
    split = [f for f in ("model", "dtype") if f in df.columns and df[f].map(norm).nunique() > 1]
    keys = ["method", df["budget"].map(norm), *(df[f].map(norm) for f in split)]
    for (method, budget, *other), rows in df.groupby(keys, sort=True):
        per_sample = [json.loads(text) for text in rows["kept_tokens_per_head"].dropna()]
        if any(min(flat) != max(flat) for flat in ([n for layer in s for n in layer] for s in per_sample)):
            dists["\n".join([str(method), f"@{budget}", *other])] = [n for s in per_sample for layer in s for n in layer]
    if not dists:
        return None
    fig, ax = plt.subplots(figsize=(max(8, 0.9 * len(dists)), 4.2))
    ax.boxplot(list(dists.values()), showfliers=True)
    ax.set_xticks(range(1, len(dists) + 1), list(dists), fontsize=7)
    ax.set_ylabel("tokens kept per KV head (all layers, samples)")
    ax.set_title(f"{spec.title}: per-head kept tokens of head-wise methods", fontsize=10)
    fig.tight_layout()
    return fig


def efficiency_figure(table: pd.DataFrame, spec: ReportSpec) -> plt.Figure | None:
    """Decode latency (with its min-max over each point's samples) and peak memory vs budget per method, from
    `kvbench.reporting.efficiency.efficiency_table`."""
    if table.empty or table["decode_ms"].isna().all():
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    budgets = sorted({norm(b) for b in table["budget"]}, key=_sort_key)
    labels = sorted(table["label"].unique())
    width = 0.8 / max(1, len(labels))
    for ax, column, ylabel in ((axes[0], "decode_ms", "decode latency (ms/token)"),
                               (axes[1], "peak_MiB", "peak memory (MiB)")):
        for i, label in enumerate(labels):
            rows = table[table["label"] == label]
            by_budget = {norm(b): v for b, v in zip(rows["budget"], rows[column])}
            ax.bar(np.arange(len(budgets)) + i * width, [by_budget.get(b, np.nan) for b in budgets], width,
                   label=label)
            if column == "decode_ms":  # the latency's spread over the point's samples
                spread_bars(ax, [budgets.index(norm(b)) + i * width for b in rows["budget"]], rows, column)
        ax.set_xticks(np.arange(len(budgets)) + 0.4 - width / 2, budgets)
        ax.set_xlabel("budget")
        ax.set_ylabel(ylabel)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{spec.title}: speed and memory ({', '.join(table['memory_basis'].unique())})", fontsize=10)
    fig.tight_layout()
    return fig


def storage_traffic_figure(table: pd.DataFrame, spec: ReportSpec) -> plt.Figure | None:
    if table.empty:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    labels = [f"{m}\n@{norm(b)}" for m, b in zip(table["method"], table["budget"])]
    for ax, column, ylabel in ((axes[0], "storage_bytes", "storage / full (true bytes)"),
                               (axes[1], "traffic", "decode traffic / full")):
        ax.bar(range(len(table)), table[column].fillna(0), tick_label=labels)
        ax.tick_params(axis="x", labelsize=7)
        ax.set_ylabel(ylabel)
    fig.suptitle(f"{spec.title}", fontsize=10)
    fig.tight_layout()
    return fig
