"""Markdown tables of a method x budget sweep from stored records: accuracy, and RocketKV Table 1's storage and
traffic columns.

    python scripts/budget_tables.py results/issue7                      # score (NLL) per method and budget
    python scripts/budget_tables.py results/issue8 --metrics score,nll,topk_recall --table1
    python scripts/budget_tables.py results/issue9 --where task.max_new_tokens=50

Rows are methods, split by eviction schedule (one-shot / block-wise M) when the sweep has both; columns are
budgets; one table per task plus the mean over tasks. `--table1` adds, per method and budget, the measured
storage (true bytes and the paper's convention) and traffic (token-equivalents read per KV group and decode
step, and that over S) next to the paper's formulas at the sample's mean compression c = S / t.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pandas as pd
from omegaconf import OmegaConf

from kvbench.results.collect import collect


def _schedule(row: pd.Series) -> str:
    block = row.get("eviction_schedule.block_size")
    return f"block {int(block)}" if isinstance(block, (int, float)) and not math.isnan(block) else "one-shot"


def load(root: Path) -> pd.DataFrame:
    df = collect(root)
    df["schedule"] = df.apply(_schedule, axis=1) if "eviction_schedule.block_size" in df else "one-shot"
    df["row"] = df["method"].astype(str)
    if df["schedule"].nunique() > 1:
        evicting = df["eviction_schedule.events"].notna() if "eviction_schedule.events" in df else False
        df.loc[evicting, "row"] = df.loc[evicting, "method"].astype(str) + " (" + df.loc[evicting, "schedule"] + ")"
    df["budget_label"] = df["budget"].map(lambda b: "-" if b is None or (isinstance(b, float) and math.isnan(b)) else int(b))
    return df


def _config_value(run_dir: Path, field: str) -> object:
    """A setting from a point's config.yaml (settings outside the point identity, e.g. task.max_new_tokens)."""
    config = OmegaConf.load(run_dir / "config.yaml")
    return OmegaConf.select(config, field, default=None)


def _matches(recorded: object, wanted: str) -> bool:
    """Points without the field are kept (e.g. a RULER point under `--where task.max_new_tokens=50`)."""
    if recorded is None or (isinstance(recorded, float) and math.isnan(recorded)):
        return True
    try:
        return float(recorded) == float(wanted)
    except (TypeError, ValueError):
        return str(recorded) == wanted


def accuracy_tables(df: pd.DataFrame, metrics: list[str]) -> str:
    out = []
    budgets = sorted({b for b in df["budget_label"] if b != "-"})
    for task, frame in [*sorted(df.groupby("task")), ("mean over tasks", df)]:
        means = frame.groupby(["row", "budget_label", "task"])[metrics].mean().groupby(["row", "budget_label"]).mean()
        counts = frame.groupby(["row", "budget_label"]).size()
        out.append(f"\n**{task}** (cells: {' / '.join(metrics)}; n = samples per cell)\n")
        out.append("| method | " + " | ".join(str(b) for b in budgets) + " | n |")
        out.append("|---" * (len(budgets) + 2) + "|")
        for row in sorted({r for r, _ in means.index}, key=lambda r: (r != "full", r)):
            cells = []
            for b in (["-"] if row == "full" else budgets):
                if (row, b) not in means.index:
                    cells.append("")
                    continue
                values = means.loc[(row, b)]
                cells.append(" / ".join(_fmt(m, values[m]) for m in metrics))
            if row == "full":
                cells = cells * len(budgets)
            n = int(counts.xs(row, level=0).max())
            out.append(f"| {row} | " + " | ".join(cells) + f" | {n} |")
    return "\n".join(out)


def _fmt(metric: str, value: float) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if metric == "score":
        return f"{100 * value:.0f}"
    if metric == "topk_recall":
        return f"{value:.3f}"
    return f"{value:.0f}" if "tokens" in metric or "bytes" in metric else f"{value:.2f}"


def paper_storage(method: str, c: float, r: float | None, page: float | None = None) -> str:
    """RocketKV Table 1's storage relative to Full-KV at compression c (traffic is 1/c for every method).
    HSA alone has no row in the paper: its page summaries over the whole cache cost 2/p by the same rule."""
    if method in ("snapkv", "streamingllm", "adakv", "pyramidkv", "ada_pyramid", "h2o", "tova", "keydiff"):
        return f"{1 / c:.3f}"
    if method == "quest":
        return f"{1 + 1 / c:.3f}"
    if method == "sparq":
        return "2"
    if method in ("rocketkv", "rocketkv_mt") and r is not None:
        aux = 2 / c ** ((1 + r) / 2)
        return f"{(1 / c**r if method == 'rocketkv' else 1) + aux:.3f}"
    if method == "hsa" and page:
        return f"{1 + 2 / page:.3f}"
    return "1" if method in ("full", "exact_topk") else "-"


def table1(df: pd.DataFrame) -> str:
    cols = ["storage_ratio_bytes", "storage_ratio_table1", "decode_read_tokens_per_group", "budget_plan.sequence_length"]
    df = df[df["budget_label"] != "-"].copy()
    for optional in ("budget_plan.r", "budget_plan.page_size"):
        if optional not in df:
            df[optional] = float("nan")
    grouped = df.groupby(["row", "budget_label"])[cols + ["budget_plan.r", "budget_plan.page_size"]].mean()
    out = ["\n| method | t | c = S/t | storage, true bytes | storage, Table 1 convention | Table 1 formula | "
           "traffic, tokens/group/step | traffic / S | formula 1/c |", "|---" * 9 + "|"]
    for (row, budget), v in grouped.iterrows():
        seq = v["budget_plan.sequence_length"]
        c = seq / budget
        r = None if math.isnan(v["budget_plan.r"]) else v["budget_plan.r"]
        page = None if math.isnan(v["budget_plan.page_size"]) else v["budget_plan.page_size"]
        method = row.split(" ")[0]
        out.append(f"| {row} | {budget} | {c:.1f} | {v['storage_ratio_bytes']:.3f} | {v['storage_ratio_table1']:.3f} | "
                   f"{paper_storage(method, c, r, page)} | {v['decode_read_tokens_per_group']:.0f} | "
                   f"{v['decode_read_tokens_per_group'] / seq:.3f} | {1 / c:.3f} |")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path)
    parser.add_argument("--metrics", default="score,nll")
    parser.add_argument("--table1", action="store_true")
    parser.add_argument("--where", action="append", default=[], metavar="FIELD=VALUE",
                        help="keep points whose field (record or config.yaml) equals VALUE, or that lack the field; repeatable")
    args = parser.parse_args()
    df = load(args.results)
    for condition in args.where:
        field, _, value = condition.partition("=")
        values = (df[field] if field in df else df["run_dir"].map(lambda d: _config_value(args.results / d, field))
                  ).astype(object)
        if values.isna().all():
            parser.error(f"--where: no record or config.yaml of these points has a field {field!r}")
        df = df[[_matches(v, value) for v in values]]
    print(accuracy_tables(df, args.metrics.split(",")))
    if args.table1:
        print(table1(df))


if __name__ == "__main__":
    main()
