"""`build`: a preset's whole report from its records: tables (md/csv/tex), figures (PNG/PDF) and one HTML page."""

from __future__ import annotations

import base64
import html
import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from kvbench.reporting.claims import html_section, verdicts, write_claims
from kvbench.reporting.efficiency import efficiency_table, render
from kvbench.reporting.lengths import compression_ratios, length_figure, length_histogram, prompt_lengths
from kvbench.reporting.paper_figures import (
    accuracy_figure,
    efficiency_figure,
    equal_traffic_figure,
    kept_tokens_figure,
    niah_heatmap_figure,
    storage_traffic_figure,
)
from kvbench.reporting.paper_tables import (
    IDENTITY,
    MISSING,
    ReportSpec,
    Source,
    _point_key,
    _row_fields,
    main_table,
    missing_points,
    point_scores,
    resolve,
    storage_traffic_table,
)
from kvbench.reporting.preset_points import left_out_lines, select_points
from kvbench.reporting.table import point_table
from kvbench.reporting.uncertainty import (
    CellRecords,
    cell_intervals,
    comparisons,
    detectable_text,
    hover_titles,
    html_table,
    interval_table,
    with_interval_columns,
)
from kvbench.results.collect import collect
from kvbench.results.stats import frame_resampled_unit

log = logging.getLogger(__name__)


def _display(table: pd.DataFrame, float_format: str = "{:.1f}") -> pd.DataFrame:
    return table.apply(lambda col: col.map(
        lambda v: float_format.format(v) if isinstance(v, (float, np.floating)) and not np.isnan(v)
        else ("-" if isinstance(v, (float, np.floating)) else str(v))))


def rounds_as_subtasks(df: pd.DataFrame) -> pd.DataFrame:
    """`report.columns: turn`: one row per sample and turn, its subtask the round ("round 1", ...) and its score
    that turn's (a record without `turn_scores` is one round), so a multi-turn task's table shows its accuracy
    per round (CTKVR Table 5) and intervals resample samples within each round."""
    rows = []
    for record in df.to_dict("records"):
        turns = record.get("turn_scores")
        scores = json.loads(turns) if isinstance(turns, str) else [record["score"]]
        rows += [{**record, "subtask": f"round {i}", "score": score} for i, score in enumerate(scores, 1)]
    out = pd.DataFrame(rows, columns=df.columns)
    out.attrs = dict(df.attrs)
    return out


def build(source: str | Path | Source, out_dir: Path | None = None, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Write the report of `source` (see the module docstring; a `Source` already resolved, or what `resolve`
    takes); returns what was written and found."""
    src = source if isinstance(source, Source) else resolve(source, overrides)
    df, left_out = select_points(src, collect(src.root))
    if src.spec.columns == "turn":
        df = rounds_as_subtasks(df)
    out = Path(out_dir) if out_dir is not None else src.root / "report"
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    if df.empty:
        points = pd.DataFrame(columns=["score", "n", "point_hash", *IDENTITY])  # every expected point missing
        subtasks = pd.DataFrame(columns=["point_hash", "subtask", "score", "n"])
    else:
        points, subtasks = point_scores(df, list(src.grid[0]) if src.grid else ())
        # the figures draw records: each under its point's name (a method variant's own), split by dtype
        key = _point_key(df)
        df = df.assign(method=df[key].map(points.set_index(key)["method"]))
    missing = missing_points(points, src.grid)
    spec = src.spec
    efficiency = efficiency_table(df) if len(points) else pd.DataFrame()
    if spec.efficiency_layout and len(points):  # synthetic prompts, no scores: the profile is the table
        table = efficiency
    elif spec.kind == "storage_traffic" and len(points):
        table = storage_traffic_table(points)
    elif spec.kind == "math" and len(points):
        table = math_table(points, _row_fields(spec, points, src.grid))
    else:
        table = main_table(src, points, subtasks)
    figures: dict[str, plt.Figure | None] = {}
    figure_paths: dict[str, Path] = {}
    if len(points):
        if spec.kind == "accuracy" and points["score"].notna().any():
            figures["accuracy"] = accuracy_figure(src, points)
            figures["accuracy_equal_traffic"] = equal_traffic_figure(src, points)
        if spec.kind == "storage_traffic":
            figures["storage_traffic"] = storage_traffic_figure(table, spec)
        figures["niah_heatmap"] = niah_heatmap_figure(df, spec)
        figures["kept_tokens"] = kept_tokens_figure(df, spec)
        figures["efficiency"] = efficiency_figure(efficiency, spec)
    if spec.efficiency_layout and len(points):
        png, pdf, csv, md = render(src.root, spec.efficiency_layout, out, records=df)
        figure_paths[spec.efficiency_layout] = png
        written += [png, pdf, csv, md]
    for name, fig in figures.items():
        if fig is None:
            continue
        png, pdf = out / f"{name}.png", out / f"{name}.pdf"
        fig.savefig(png, dpi=120)
        fig.savefig(pdf)
        plt.close(fig)
        figure_paths[name] = png
        written += [png, pdf]
    precise = spec.kind in ("storage_traffic", "math") or spec.efficiency_layout
    shown = _display(table, "{:.4g}" if precise else "{:.1f}")
    stats = _uncertainty(table, spec, df) if "cells" in table.attrs and len(points) else None
    unit = frame_resampled_unit(df) if len(df) else "samples"  # what the intervals resampled
    (with_interval_columns(table, stats["estimates"]) if stats else table).to_csv(out / "table.csv", index=False)
    (out / "table.md").write_text(shown.to_markdown(index=False, disable_numparse=True) + "\n")
    latex = shown.to_latex(index=False, caption=spec.title, label=f"tab:{src.name}")
    if stats:  # the paper's layout stays one number a cell; the intervals are a second table of that layout
        latex += "\n" + stats["intervals"].to_latex(
            index=False, caption=f"{spec.title}: {intervals_caption(spec, unit)}".replace("%", "\\%"),
            label=f"tab:{src.name}-ci")
        stats["comparisons"].to_csv(out / "comparisons.csv", index=False)
        written.append(out / "comparisons.csv")
    (out / "table.tex").write_text(latex)
    if len(df):
        point_table(df).to_csv(out / "points.csv", index=False)
        written.append(out / "points.csv")
    written += [out / "table.csv", out / "table.md", out / "table.tex"]
    skipped = skipped_line(src.name, spec)
    dtypes = sorted({str(d) for d in points["dtype"].dropna()}) if "dtype" in points else []
    facts = {"points": len(points), "records": len(df), "missing": missing, "skipped": skipped,
             "left_out": left_out_lines(left_out), "dtypes": dtypes, "stats": stats, "unit": unit,
             "interval_note": math_interval_note(unit) if spec.kind == "math" and len(points) else None}
    (out / "report.md").write_text(_markdown(src, shown, figure_paths, facts))
    (out / "index.html").write_text(_html(src, shown, figure_paths, facts))
    written += [out / "report.md", out / "index.html"]
    if spec.length_statistics and len(df):
        written += _length_statistics(df, out)
    if verdicts(src.root):  # `kvbench analyze` verdicts stored beside the points: their table joins the report
        claims = write_claims(src.root, out, src.spec.title, pages=False)
        _append_section(out, "\n## Claims about attention\n\n" + (out / "claims.md").read_text(),
                        html_section(claims["table"], claims["figures"]))
        written += [out / "claims.md", out / "claims.csv", *claims["figures"].values()]
    return {"out_dir": out, "written": written, "figures": figure_paths, "table": table, "missing": missing,
            "points": points, "source": src, "left_out": left_out, "stats": stats}


def _length_statistics(df: pd.DataFrame, out: Path) -> list[Path]:
    """`report.length_statistics`: the data set's prompt lengths against the sweep's budgets (KeyDiff Tables 7-8,
    Fig. 18; `reporting.lengths`), as files and as a section of report.md and index.html."""
    budgets = sorted({int(b) for b in pd.to_numeric(df.get("budget"), errors="coerce").dropna() if b >= 1})
    lengths = prompt_lengths(df)
    if not budgets or lengths.empty:
        return []
    tables = {"prompt_lengths": ("Prompts per length range (KeyDiff Table 7)", length_histogram(lengths, budgets)),
              "compression_ratio": ("Average compression ratio, mean of min(1, budget / length) (KeyDiff Table 8)",
                                    compression_ratios(lengths, budgets).round(2))}
    written, markdown, parts = [], ["\n## Prompt lengths against the budgets\n"], ["<h2>Prompt lengths against the budgets</h2>"]
    for name, (title, table) in tables.items():
        table.to_csv(out / f"{name}.csv", index=False)
        (out / f"{name}.md").write_text(table.to_markdown(index=False) + "\n")
        written += [out / f"{name}.csv", out / f"{name}.md"]
        markdown += [f"### {title}\n", table.to_markdown(index=False), ""]
        parts.append(f"<h3>{html.escape(title)}</h3>" + table.to_html(index=False, escape=True))
    fig = length_figure(lengths, budgets)
    png, pdf = out / "prompt_lengths.png", out / "prompt_lengths.pdf"
    fig.savefig(png, dpi=120)
    fig.savefig(pdf)
    plt.close(fig)
    written += [png, pdf]
    data = base64.b64encode(png.read_bytes()).decode()
    parts.append(f"<h3>Prompt lengths per subtask (KeyDiff Fig. 18)</h3><img alt='prompt lengths' "
                 f"src='data:image/png;base64,{data}'><p><a href='prompt_lengths.pdf'>PDF</a></p>")
    markdown.append("![prompt lengths per subtask (KeyDiff Fig. 18)](prompt_lengths.png)\n")
    _append_section(out, "\n".join(markdown), "\n".join(parts))
    return written


def _append_section(out: Path, markdown: str, html_part: str) -> None:
    """A section after the report's own: appended to report.md, and to index.html before its end."""
    with open(out / "report.md", "a") as report:
        report.write(markdown)
    page = out / "index.html"
    page.write_text(page.read_text().replace("</body></html>", html_part + "\n</body></html>"))


def intervals_caption(spec: ReportSpec, unit: str = "samples") -> str:
    """What the intervals table holds; `unit`: what they resampled (`kvbench.results.stats.resampled_unit`)."""
    return (f"95% bootstrap intervals over {unit} (stratified by subtask) and sample counts"
            + ("; a difference's: its paired comparison with the reference" if spec.delta else "")
            + "; n alone: too few samples for an interval")


COMPARISONS_INTRO = ("Each series against the reference of its row group, and the preset's own comparisons, "
                     "paired over the samples both ran: the mean difference (score points) with its 95% bootstrap "
                     "interval; an interval containing 0 is not distinguishable.")


def _uncertainty(table: pd.DataFrame, spec: ReportSpec, records: pd.DataFrame) -> dict[str, Any]:
    """The table's cell intervals, its paired comparisons and what they can detect (`uncertainty`)."""
    cells = CellRecords(table, records, _point_key(records))
    estimates = cell_intervals(table, spec, cells)
    headline = table.attrs["value_columns"] if spec.columns == "budget" else ["avg"]
    pairs, detectable = comparisons(table, spec, cells, headline)
    shown_pairs = pairs.copy()
    for column in ("difference", "ci_low", "ci_high"):
        shown_pairs[column] = [f"{v:+.1f}" if column == "difference" and pd.notna(v) else
                               f"{v:.1f}" if pd.notna(v) else "-" for v in pairs[column]]
    return {"estimates": estimates, "intervals": interval_table(table, estimates), "comparisons": pairs,
            "comparisons_shown": shown_pairs.astype(str), "titles": hover_titles(table, estimates),
            "detectable": detectable}


def skipped_line(name: str, spec: ReportSpec) -> str | None:
    """One line naming the paper's methods that kvbench lacks (their rows are skipped)."""
    if not spec.not_in_kvbench:
        return None
    return f"{name}: skipping methods not in kvbench: {', '.join(spec.not_in_kvbench)}"


def _dtypes(facts: Mapping[str, Any]) -> str:
    return f"; dtype {', '.join(facts['dtypes'])}" if facts["dtypes"] else ""


def _markdown(src: Source, shown: pd.DataFrame, figures: Mapping[str, Path], facts: Mapping[str, Any]) -> str:
    lines = [f"# {src.spec.title}", "", f"Records under `{src.root}`: {facts['points']} points, "
             f"{facts['records']} records{_dtypes(facts)}.", ""]
    if src.spec.note:
        lines += [src.spec.note, ""]
    if facts["skipped"]:
        lines += [facts["skipped"], ""]
    if facts["left_out"]:
        lines += [facts["left_out"][0], "", *(f"- `{line.strip()}`" for line in facts["left_out"][1:]), ""]
    if facts["missing"]:
        lines += [f"{len(facts['missing'])} expected points have no records (shown as `{MISSING}`):", ""]
        lines += [f"- {', '.join(f'{k}={v}' for k, v in p.items())}" for p in facts["missing"]] + [""]
    lines += [shown.to_markdown(index=False, disable_numparse=True), ""]
    if facts["interval_note"]:
        lines += [facts["interval_note"], ""]
    stats = facts["stats"]
    if stats:
        caption = intervals_caption(src.spec, facts["unit"])
        lines += [f"{caption[0].upper()}{caption[1:]}:", "",
                  stats["intervals"].to_markdown(index=False, disable_numparse=True), "",
                  detectable_text(stats["detectable"], src.name, facts["unit"]), "", "## Paired comparisons", "",
                  COMPARISONS_INTRO, "", stats["comparisons_shown"].to_markdown(index=False, disable_numparse=True), ""]
    lines += [f"![{name}]({path.name})" for name, path in figures.items()]
    return "\n".join(lines) + "\n"


def _html(src: Source, shown: pd.DataFrame, figures: Mapping[str, Path], facts: Mapping[str, Any]) -> str:
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(src.spec.title)}</title>",
             "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;font-size:13px}"
             "td,th{border:1px solid #ccc;padding:3px 7px;text-align:right}img{max-width:100%}</style></head><body>",
             f"<h1>{html.escape(src.spec.title)}</h1>",
             f"<p>Records under <code>{html.escape(str(src.root))}</code>: {facts['points']} points, "
             f"{facts['records']} records{html.escape(_dtypes(facts))}.</p>"]
    if src.spec.note:
        parts.append(f"<p>{html.escape(src.spec.note)}</p>")
    if facts["skipped"]:
        parts.append(f"<p>{html.escape(facts['skipped'])}</p>")
    if facts["left_out"]:
        items = "".join(f"<li><code>{html.escape(line.strip())}</code></li>" for line in facts["left_out"][1:])
        parts.append(f"<p>{html.escape(facts['left_out'][0])}</p><ul>{items}</ul>")
    if facts["missing"]:
        items = "".join(f"<li>{html.escape(', '.join(f'{k}={v}' for k, v in p.items()))}</li>"
                        for p in facts["missing"])
        parts.append(f"<p>{len(facts['missing'])} expected points have no records (shown as "
                     f"<em>{MISSING}</em>):</p><ul>{items}</ul>")
    stats = facts["stats"]
    if stats:
        parts.append("<h2>Table</h2><p>Hover a cell for its 95% interval and sample count.</p>"
                     + html_table(shown, stats["titles"]))
    else:
        parts.append("<h2>Table</h2>" + shown.to_html(index=False, escape=True))
    if facts["interval_note"]:
        parts.append(f"<p>{html.escape(facts['interval_note'])}</p>")
    parts.append("<p>Also as <a href='table.csv'>CSV</a> (with each cell's n and interval), <a href='table.tex'>"
                 "LaTeX</a>, <a href='table.md'>markdown</a>; every point and subtask: <a href='points.csv'>"
                 "points.csv</a>" + ("; the paired comparisons: <a href='comparisons.csv'>comparisons.csv</a>"
                                     if stats else "") + ".</p>")
    if stats:
        caption = intervals_caption(src.spec, facts["unit"])
        parts.append(f"<h2>95% intervals</h2><p>{html.escape(caption[0].upper() + caption[1:])}.</p>"
                     + stats["intervals"].to_html(index=False, escape=True))
        parts.append(f"<p>{html.escape(detectable_text(stats['detectable'], src.name, facts['unit']))}</p>")
        parts.append(f"<h2>Paired comparisons</h2><p>{html.escape(COMPARISONS_INTRO)}</p>"
                     + stats["comparisons_shown"].to_html(index=False, escape=True))
    for name, path in figures.items():
        data = base64.b64encode(path.read_bytes()).decode()
        parts.append(f"<h2>{name}</h2><img alt='{name}' src='data:image/png;base64,{data}'>"
                     f"<p><a href='{path.stem}.pdf'>PDF</a></p>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def math_interval_note(unit: str) -> str:
    """Under KeyDiff's math table: what its interval columns are."""
    return (f"flex_match_ci_low, flex_match_ci_high: the 95% bootstrap interval of flex_match over {unit}, "
            f"stratified by subtask.")


def math_table(points: pd.DataFrame, rows: list[str]) -> pd.DataFrame:
    """KeyDiff Table 3: flexible match (the score, with its sample count and 95% interval), exact match and mean
    generation length per point."""
    fields = [f for f in dict.fromkeys(["task.max_new_tokens", *rows, "budget"]) if f in points.columns]
    out = points[fields].copy()
    out["n"] = points["n"]
    out["flex_match"] = points["score"] / 100.0
    out["flex_match_ci_low"], out["flex_match_ci_high"] = points["ci_low"] / 100.0, points["ci_high"] / 100.0
    out["exact_match"] = pd.to_numeric(points.get("extra.math_exact"), errors="coerce")
    out["avg_gen_length"] = pd.to_numeric(points.get("new_tokens"), errors="coerce")
    return out.reset_index(drop=True)
