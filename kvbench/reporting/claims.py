"""The claims section of a report: every `verdict.json` under a results tree (written by `kvbench analyze`) in
one table (claim, paper's number, measured, 95% interval, verdict), with each claim's figure."""

from __future__ import annotations

import base64
import html
import json
import shutil
from pathlib import Path
from typing import Any

import pandas as pd

from kvbench.results.store import VERDICT_FILE

COLUMNS = ["paper", "claim", "source", "paper_number", "measured", "ci_95", "n", "verdict", "model", "task"]


def verdicts(root: Path) -> list[dict[str, Any]]:
    """The verdicts stored under `root`, ordered by paper and claim."""
    found = [json.loads(p.read_text()) | {"_dir": str(p.parent)} for p in sorted(Path(root).rglob(VERDICT_FILE))]
    return sorted(found, key=lambda v: (v["paper"], v["claim"], v.get("model") or "", v.get("task") or ""))


def verdict_table(found: list[dict[str, Any]]) -> pd.DataFrame:
    rows = [{"paper": v["paper"], "claim": v["claim"], "source": v["source"], "paper_number": v["paper_number"],
             "measured": f"{v['effect_name']} = {v['effect']:.3g}", "ci_95": f"[{v['ci_low']:.3g}, {v['ci_high']:.3g}]" if v.get("ci_low") is not None else "-",
             "n": v["n"], "verdict": v["verdict"], "model": v.get("model") or "-", "task": v.get("task") or "-"}
            for v in found]
    return pd.DataFrame(rows, columns=COLUMNS)


def write_claims(root: Path, out: Path, title: str, pages: bool = True) -> dict[str, Any]:
    """`claims.md`, `claims.csv` and the figures (copied beside them) under `out`; with `pages`, also
    `report.md` and `index.html` (a point report adds the section to its own pages instead)."""
    found = verdicts(root)
    out.mkdir(parents=True, exist_ok=True)
    table = verdict_table(found)
    table.to_csv(out / "claims.csv", index=False)
    text = table.to_markdown(index=False, disable_numparse=True)
    (out / "claims.md").write_text(text + "\n")
    figures: dict[str, Path] = {}
    for v in found:
        source = Path(v["_dir"]) / v["figure"]
        if source.exists():
            name = f"{v['claim']}{'' if v.get('model') is None else '_' + v['model'].replace('/', '--')}"
            for suffix in (".png", ".pdf"):
                if source.with_suffix(suffix).exists():
                    shutil.copyfile(source.with_suffix(suffix), out / f"{name}{suffix}")
            figures[name] = out / f"{name}.png"
    if not pages:
        return {"out_dir": out, "table": table, "figures": figures, "verdicts": found}
    rules = [f"- `{v['claim']}`: {v['rule']}" for v in found]
    lines = [f"# {title}", "", f"Verdicts under `{root}`: {len(found)}.", "", text, "", "Verdict rules:", "", *rules, ""]
    (out / "report.md").write_text("\n".join(lines + [f"![{n}]({p.name})" for n, p in figures.items()]) + "\n")
    (out / "index.html").write_text(_html(title, table, figures))
    return {"out_dir": out, "table": table, "figures": figures, "verdicts": found}


def html_section(table: pd.DataFrame, figures: dict[str, Path]) -> str:
    parts = ["<h2>Claims about attention</h2>" + table.to_html(index=False, escape=True)]
    for name, path in figures.items():
        data = base64.b64encode(path.read_bytes()).decode()
        parts.append(f"<h3>{html.escape(name)}</h3><img alt='{html.escape(name)}' src='data:image/png;base64,{data}'>"
                     f"<p><a href='{path.stem}.pdf'>PDF</a></p>")
    return "\n".join(parts)


def _html(title: str, table: pd.DataFrame, figures: dict[str, Path]) -> str:
    return ("<!doctype html><html><head><meta charset='utf-8'>"
            f"<title>{html.escape(title)}</title><style>body{{font-family:sans-serif;margin:2em}}"
            "table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;padding:3px 7px}"
            f"img{{max-width:100%}}</style></head><body><h1>{html.escape(title)}</h1>\n"
            f"{html_section(table, figures)}\n</body></html>\n")
