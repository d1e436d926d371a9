"""The papers' efficiency figures from stored profiled records (`profile=true` points).

    python -m kvbench.figures results/rocketkv_fig7_cpu --layout rocketkv_fig7 [--out DIR]

Layouts (each preset's comment names its own):

- `rocketkv_fig7`: decode speedup over Full-KV and peak-memory saving vs token budget, one line per
  sequence length (RocketKV Fig. 7); dashed, the speedup over the paper's repeated-K/V dense baseline where
  `full_repeated_kv` ran, and how much of the speedup that baseline explains (`baseline_factor`).
- `omnikv_fig4`: decode latency per token and time to first token vs context length, one line per method;
  a point that ran out of memory is drawn as an "OOM" mark, never as a value (OmniKV Fig. 4).
- `keydiff_latency`: time to first token of block-wise prefill, and its peak memory, vs cache budget (KeyDiff
  Figs 7 and 17).
- `ctkvr_throughput`: decode tokens/s (new tokens over decode time, CTKVR's measure) and peak memory per
  method and setting, with the speedup over Full KV (CTKVR's throughput results, at batch 1).
- `ctkvr_table13`: a decode step's time by CTKVR module (Table 13: Q2Q(c) recall, Q2K rerank, the host-side
  and resident attention, and what the paper leaves out: DCU, the rest of the step), from stage-timed points
  (`profiler.stages=true`), in ms and as shares of the step.

Each writes `<layout>.png`, `<layout>.pdf`, `<layout>.csv` and `<layout>.md` (the table behind the figure,
with roofline utilisations where the records have them) into `--out` (default: the results directory).
Points are aggregated over their samples (medians), with the spread of the timings over those samples (min and
max columns, error bars; Full's and the method's together for a speedup); a missing point is absent from the
figure, not zero.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from kvbench.reporting.table import method_labels
from kvbench.results.collect import collect

MiB = 2**20


COLUMNS = {  # table column <- record column (profile fields flattened by `collect`)
    "decode_ms": "profile.decode_ms_median",
    "decode_ms_p90": "profile.decode_ms_p90",
    "ttft_s": "profile.ttft_s",
    "tokens_per_s": "profile.tokens_per_s",
    "peak_prefill_MiB": "profile.peak_bytes_prefill",
    "peak_decode_MiB": "profile.peak_bytes_decode",
    "kv_end_MiB": "kv_bytes_end",
    "state_peak_MiB": "profile.state_peak_bytes",
    "prefill_compute_util": "roofline.prefill_compute_util",
    "decode_bandwidth_util": "roofline.decode_bandwidth_util",
}


def efficiency_table(records: Path | pd.DataFrame) -> pd.DataFrame:
    """One row per profiled point: its label, budget and length, medians of the profile fields over its
    samples, and whether any sample ran out of memory. `records`: a results directory, or its records
    (`collect`) as a report selected them."""
    df = collect(records) if isinstance(records, (str, Path)) else records
    if df.empty or "profile.decode_ms_median" not in df.columns and "oom" not in df.columns:
        return pd.DataFrame()
    df = df.copy()
    df["oom"] = df["oom"].fillna(False).astype(bool) if "oom" in df.columns else False
    df["label"] = _labels(df)
    rows = []
    for (label, budget, seq_len), points in df.groupby(["label", "budget", "seq_len"], dropna=False, sort=True):
        ok = points[~points["oom"]]
        row = {"label": label, "method": points["method"].iloc[0], "budget": budget, "seq_len": seq_len,
               "n": len(ok), "oom": bool(points["oom"].any())}
        for name, column in COLUMNS.items():
            value = pd.to_numeric(ok[column], errors="coerce").median() if column in ok and len(ok) else None
            row[name] = value / MiB if value is not None and name.endswith("MiB") else value
        for name in SPREAD:  # the spread over the point's samples behind each median
            values = pd.to_numeric(ok[COLUMNS[name]], errors="coerce") if COLUMNS[name] in ok else pd.Series([])
            row[f"{name}_min"], row[f"{name}_max"] = (values.min(), values.max()) if values.notna().any() else (
                None, None)
        # stage-timed points (`profiler.stages`): each stage's mean ms per step, and the mean step they add up
        # within; means over the samples (not medians), so a step's parts still add up to it
        for column in [c for c in ok.columns if c.startswith(STAGE_PREFIX)] if len(ok) else []:
            row[f"stage_ms.{column[len(STAGE_PREFIX):]}"] = pd.to_numeric(ok[column], errors="coerce").fillna(0).mean()
        if "profile.decode_ms_mean" in ok and len(ok):
            row["step_ms_mean"] = pd.to_numeric(ok["profile.decode_ms_mean"], errors="coerce").mean()
        row["decode_tokens_per_s"] = 1e3 / row["decode_ms"] if row["decode_ms"] else None  # CTKVR's measure
        row["decode_tokens_per_s_min"] = 1e3 / row["decode_ms_max"] if row["decode_ms_max"] else None
        row["decode_tokens_per_s_max"] = 1e3 / row["decode_ms_min"] if row["decode_ms_min"] else None
        repeat = points["method_params.repeat_kv"].iloc[0] if "method_params.repeat_kv" in points else None
        row["repeated_kv"] = bool(repeat) if pd.notna(repeat) else False  # gpt-fast's dense baseline
        row["dtype"] = points["dtype"].iloc[0] if "dtype" in points else None
        # which dense attention the decode steps ran (`decode_attention` of the records): a speedup over Full-KV
        # names the attention of the Full-KV it divides by; records from before the field have none
        attention = ok["decode_attention"].dropna().unique() if "decode_attention" in ok else []
        row["decode_attention"] = "/".join(sorted(map(str, attention))) or None
        # the peak a figure compares: CUDA's allocator peak; on CPU weights, K/V peak and method state (its
        # indexes and host rows) from exact accounting,
        # since the process RSS carries the allocator's history across the points of one process
        cuda = "profile.memory_kind" in ok and (ok["profile.memory_kind"] == "cuda_allocator").any()
        row["memory_basis"] = "cuda allocator peak" if cuda else "weights + K/V peak + method state"
        row["peak_MiB"] = (max((v for v in (row["peak_prefill_MiB"], row["peak_decode_MiB"]) if pd.notna(v)),
                               default=None) if cuda else row["state_peak_MiB"])
        rows.append(row)
    return pd.DataFrame(rows)


STAGE_PREFIX = "profile.stage_ms."  # a record's stage timings (kvbench.core.stages), flattened by `collect`

# Timings whose spread over a point's samples the tables give (`<name>_min`, `<name>_max`, beside the median)
# and the figures draw as error bars: each sample's own value is already its median over decode steps and
# profiler repeats, so the bars span what repeating the measurement on other prompts of the point gave.
SPREAD = ("decode_ms", "ttft_s", "tokens_per_s")


def spread_bars(ax: plt.Axes, xs: Sequence[float], rows: pd.DataFrame, column: str, low: pd.Series | None = None,
                high: pd.Series | None = None, **kwargs: Any) -> None:
    """`column`'s min-max over each point's samples as error bars at `xs` (`low`, `high`: other bounds, e.g.
    of a ratio); a point measured on one sample gets none, not a zero-length bar."""
    low = rows[f"{column}_min"] if low is None else low
    high = rows[f"{column}_max"] if high is None else high
    mid = pd.to_numeric(rows[column], errors="coerce")
    has = ((rows["n"] >= 2) & low.notna() & high.notna() & mid.notna()).to_numpy()
    if has.any():
        x = np.asarray(xs, dtype=float)[has]
        ax.errorbar(x, mid[has], yerr=[mid[has] - low[has], high[has] - mid[has]], fmt="none", capsize=3,
                    elinewidth=1, **{"ecolor": "black", **kwargs})


def _labels(df: pd.DataFrame) -> pd.Series:
    """The method, named by variant (`method_labels`), and the model and dtype where points differ in them: a
    line or a median never spans two of either."""
    labels = method_labels(df, exclude=("profile",)).astype(str)  # every point here is profiled
    for field in ("model", "dtype"):
        if field in df.columns and df[field].nunique() > 1:
            labels = labels + " " + df[field].astype(str)
    return labels


def _with_full(table: pd.DataFrame, key: str) -> pd.DataFrame:
    """Rows of the compressed methods with Full-KV's decode time and peak at the same `key` value, and the
    decode time of the repeated-K/V dense baseline (`full_repeated_kv`) where it ran."""
    dense, repeated = table["method"] == "full", table["repeated_kv"]
    full, baseline = table[dense & ~repeated].set_index(key), table[dense & repeated].set_index(key)
    out = table[~dense].copy()
    out["full_decode_ms"] = out[key].map(full["decode_ms"]) if len(full) else None
    for bound in ("min", "max"):
        out[f"full_decode_ms_{bound}"] = out[key].map(full[f"decode_ms_{bound}"]) if len(full) else None
    out["full_peak_MiB"] = out[key].map(full["peak_MiB"]) if len(full) else None
    out["full_decode_attention"] = out[key].map(full["decode_attention"]) if len(full) else None
    out["repeated_kv_decode_ms"] = out[key].map(baseline["decode_ms"]) if len(baseline) else float("nan")
    return out


def _log2_ticks(ax: plt.Axes, values: pd.Series) -> None:
    ax.set_xscale("log", base=2)
    ticks = sorted({float(v) for v in values.dropna()})
    ax.set_xticks(ticks, [f"{v:g}" for v in ticks])
    ax.minorticks_off()


def rocketkv_fig7(table: pd.DataFrame, axes: Sequence[plt.Axes]) -> pd.DataFrame:
    """Speedup over the GQA-aware full cache (solid) and, where `full_repeated_kv` ran, over the paper's own
    dense baseline, K/V repeated to every query head (dashed). `baseline_factor` = repeated-K/V full / full:
    the part of the paper's speedup that its baseline, not the method, explains."""
    rows = _with_full(table, "seq_len")
    rows["speedup"] = rows["full_decode_ms"] / rows["decode_ms"]
    # every ratio the two points' samples could give: Full's fastest over the method's slowest, and back
    rows["speedup_min"] = rows["full_decode_ms_min"] / rows["decode_ms_max"]
    rows["speedup_max"] = rows["full_decode_ms_max"] / rows["decode_ms_min"]
    rows["speedup_vs_repeated_kv"] = rows["repeated_kv_decode_ms"] / rows["decode_ms"]
    rows["baseline_factor"] = rows["repeated_kv_decode_ms"] / rows["full_decode_ms"]
    rows["memory_saving_pct"] = 100 * (1 - rows["peak_MiB"] / rows["full_peak_MiB"])
    for (label, seq_len), line in rows.groupby(["label", "seq_len"]):
        line = line.sort_values("budget")
        (drawn,) = axes[0].plot(line["budget"], line["speedup"], marker="o", label=f"{label} @ {seq_len}")
        spread_bars(axes[0], line["budget"], line, "speedup", ecolor=drawn.get_color())
        if line["speedup_vs_repeated_kv"].notna().any():
            axes[0].plot(line["budget"], line["speedup_vs_repeated_kv"], marker="o", linestyle="--",
                         color=drawn.get_color(), label=f"{label} @ {seq_len} vs repeated K/V")
        axes[1].plot(line["budget"], line["memory_saving_pct"], marker="o", label=f"{label} @ {seq_len}")
    baseline = ", ".join(sorted({str(a) for a in rows["full_decode_attention"].dropna()}))
    speedup_label = f"decode speedup over Full-KV{f' ({baseline})' if baseline else ''} (x)"
    for ax, ylabel in zip(axes, (speedup_label, "peak memory saving (%)")):
        _log2_ticks(ax, rows["budget"])
        ax.set_xlabel("token budget")
        ax.set_ylabel(ylabel)
    axes[0].axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    return rows


def omnikv_fig4(table: pd.DataFrame, axes: Sequence[plt.Axes]) -> pd.DataFrame:
    for ax, column, ylabel in ((axes[0], "decode_ms", "decode latency (ms/token)"),
                               (axes[1], "ttft_s", "time to first token (s)")):
        for label, line in table.groupby("label"):
            line = line.sort_values("seq_len")
            done = line[~line["oom"]]
            (drawn,) = ax.plot(done["seq_len"], done[column], marker="o", label=label)
            spread_bars(ax, done["seq_len"], done, column, ecolor=drawn.get_color())
            for seq_len in line[line["oom"]]["seq_len"]:  # OOM: a mark at the top, never a value
                ax.plot([seq_len], [1], marker="x", color=drawn.get_color(), transform=ax.get_xaxis_transform(),
                        clip_on=False)
                ax.annotate("OOM", (seq_len, 1), xycoords=("data", "axes fraction"), ha="center", va="bottom",
                            color=drawn.get_color(), fontsize=8)
        _log2_ticks(ax, table["seq_len"])
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel(ylabel)
    return table


def keydiff_latency(table: pd.DataFrame, axes: Sequence[plt.Axes]) -> pd.DataFrame:
    for label, line in table.groupby("label"):
        line = line.sort_values("budget")
        (drawn,) = axes[0].plot(line["budget"], line["ttft_s"], marker="o", label=label)
        spread_bars(axes[0], line["budget"], line, "ttft_s", ecolor=drawn.get_color())
        axes[1].plot(line["budget"], line["peak_MiB"], marker="o", label=label)
    for ax, ylabel in zip(axes, ("time to first token (s)", "peak memory (MiB)")):
        ax.set_xlabel("cache budget (tokens per head)")
        ax.set_ylabel(ylabel)
    return table


def ctkvr_throughput(table: pd.DataFrame, axes: Sequence[plt.Axes]) -> pd.DataFrame:
    rows = table.sort_values(["seq_len", "label"]).copy()
    full = rows[rows["method"] == "full"].set_index("seq_len")["decode_tokens_per_s"]
    rows["speedup_vs_full"] = rows["decode_tokens_per_s"] / rows["seq_len"].map(full) if len(full) else None
    names = [f"{label}\n@{seq_len}" for label, seq_len in zip(rows["label"], rows["seq_len"])]
    axes[0].bar(range(len(rows)), rows["decode_tokens_per_s"].fillna(0), tick_label=names,
                color=["grey" if m == "full" else "tab:blue" for m in rows["method"]])
    spread_bars(axes[0], range(len(rows)), rows, "decode_tokens_per_s")
    for i, oom in enumerate(rows["oom"]):
        if oom:
            axes[0].annotate("OOM", (i, 0), ha="center", va="bottom")
    axes[0].set_ylabel("decode throughput (tokens/s, batch 1)")
    axes[1].bar(range(len(rows)), rows["peak_MiB"].fillna(0), tick_label=names,
                color=["grey" if m == "full" else "tab:blue" for m in rows["method"]])
    axes[1].set_ylabel("peak memory (MiB)")
    return rows


# CTKVR Table 13's modules <- the stages that time them. The paper attends its retrieved rows where they live;
# kvbench first copies them out of the host segment (`select/gather`), counted as host-side attention here.
TABLE13 = (
    ("Q2Q(c) recall", ("select/recall",)),
    ("Q2K rerank", ("select/rerank",)),
    ("host attention", ("select/gather", "attention/external")),
    ("DCU", ("select/dcu",)),
)


def ctkvr_table13(table: pd.DataFrame, axes: Sequence[plt.Axes]) -> pd.DataFrame:
    """A decode step's mean time by module: Table 13's four (the resident attention is the rest of `attention`:
    the dense attention of a method that selects nothing, Full KV's), then DCU, a selection's other work, and
    the rest of the step (projections, MLP, norms, the token's choice), each in ms and as a share of the step."""
    if not any(c.startswith("stage_ms.") for c in table.columns):
        raise ValueError("no stage timings in these records: run the points with profile=true profiler.stages=true")
    rows = table.sort_values(["seq_len", "label"]).copy()

    def stage(name: str) -> pd.Series:
        column = f"stage_ms.{name}"
        return rows[column].fillna(0.0) if column in rows else pd.Series(0.0, index=rows.index)

    parts = {f"{module} ms": sum(stage(name) for name in names) for module, names in TABLE13}
    parts["resident attention ms"] = stage("attention") - stage("attention/external")
    named_selection = sum(stage(name) for _, names in TABLE13 for name in names if name.startswith("select/"))
    parts["other selection ms"] = stage("select") - named_selection
    parts["rest of step ms"] = rows["step_ms_mean"] - stage("select") - stage("attention")
    for name, values in parts.items():
        rows[name] = values
    names = [f"{label}\n@{seq_len}" for label, seq_len in zip(rows["label"], rows["seq_len"])]
    left = np.zeros(len(rows))
    for name in parts:
        values = rows[name].to_numpy(dtype=float)
        axes[0].barh(range(len(rows)), values, left=left, label=name.removesuffix(" ms"))
        axes[1].barh(range(len(rows)), 100 * values / rows["step_ms_mean"].to_numpy(dtype=float),
                     left=100 * left / rows["step_ms_mean"].to_numpy(dtype=float))
        left += values
    for ax, xlabel in zip(axes, ("ms per decode step (mean)", "share of the step (%)")):
        ax.set_yticks(range(len(rows)), names)
        ax.set_xlabel(xlabel)
    keep = ["label", "method", "budget", "seq_len", "n", "step_ms_mean", *parts, "decode_attention", "dtype"]
    return rows[[c for c in keep if c in rows]]


LAYOUTS: dict[str, Callable[[pd.DataFrame, Sequence[plt.Axes]], pd.DataFrame]] = {
    "rocketkv_fig7": rocketkv_fig7,
    "omnikv_fig4": omnikv_fig4,
    "keydiff_latency": keydiff_latency,
    "ctkvr_throughput": ctkvr_throughput,
    "ctkvr_table13": ctkvr_table13,
}


def figure_title(layout: str, table: pd.DataFrame, records: pd.DataFrame) -> str:
    """What a figure shows, never where it was read from (a results directory is a machine's path): the preset
    the records were swept by (else the layout), the model, the dtype and what its memory axis measures."""
    def values(frame: pd.DataFrame, column: str) -> str:
        return ", ".join(sorted(str(v) for v in frame[column].dropna().unique())) if column in frame else ""

    name = values(records, "choice.experiment") or layout
    settings = [values(records, "model"), values(table, "dtype")]
    basis = values(table, "memory_basis")
    text = "; ".join(s for s in settings if s) + (f"; memory: {basis}" if basis else "")
    return f"{name}: {text}" if text else name


def render(results_root: Path, layout: str, out_dir: Path | None = None,
           records: pd.DataFrame | None = None) -> list[Path]:
    """Write the layout's figure (PNG, PDF) and table (CSV, markdown); returns the paths written. `records`:
    the records of `results_root` to draw (a report's selection), default all of them."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; layouts: {', '.join(LAYOUTS)}")
    records = collect(results_root) if records is None else records
    table = efficiency_table(records)
    if table.empty:
        raise ValueError(f"no profiled records under {results_root} (run the preset with profile=true)")
    out_dir = Path(out_dir or results_root)
    out_dir.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    shown = LAYOUTS[layout](table, axes)
    handles = {label: h for ax in axes for h, label in zip(*ax.get_legend_handles_labels())}
    if handles:
        fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=min(4, len(handles)), fontsize=8,
                   frameon=False)
    fig.suptitle(figure_title(layout, table, records), fontsize=10)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    paths = [out_dir / f"{layout}.{ext}" for ext in ("png", "pdf", "csv", "md")]
    fig.savefig(paths[0], dpi=120)
    fig.savefig(paths[1])
    plt.close(fig)
    shown.to_csv(paths[2], index=False)
    paths[3].write_text(shown.to_markdown(index=False, floatfmt=".4g") + "\n")
    return paths
