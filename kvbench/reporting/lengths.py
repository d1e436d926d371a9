"""KeyDiff App. F.3 (Tables 7-8, Fig. 18) from a sweep's own records: the data set's prompt lengths in the
evaluated model's tokens, per subtask, against the sweep's cache budgets.

- `length_histogram` (Table 7): how many of each subtask's prompts fall below the smallest budget, between
  consecutive budgets, and at or above the largest;
- `compression_ratios` (Table 8): KeyDiff's average compression ratio per budget B, the mean over a subtask's
  prompts of min(1, B / L_i) (1 where the prompt fits: nothing is compressed), and the mean over the subtasks as
  the paper's "average" row;
- `length_figure` (Fig. 18): each subtask's prompt lengths, the budgets marked.

A prompt's length is the record's `prompt_tokens` (context and question after the chat template, before
generation; the paper counts the raw sample in Llama's tokenizer): the same for every point of one model, so each
(model, subtask, sample) counts once.
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import pandas as pd


def prompt_lengths(records: pd.DataFrame) -> pd.DataFrame:
    """One row per (model, subtask, sample) with its `prompt_tokens`; records without a length are left out."""
    if records.empty or "prompt_tokens" not in records:
        return pd.DataFrame(columns=["model", "subtask", "sample_id", "prompt_tokens"])
    rows = records.dropna(subset=["prompt_tokens"])
    return (rows[["model", "subtask", "sample_id", "prompt_tokens"]]
            .drop_duplicates(["model", "subtask", "sample_id"]).reset_index(drop=True))


def _kilo(tokens: int) -> str:
    """A budget as the paper writes it: 2K for 2048, the count itself where it is no whole number of K."""
    return f"{tokens // 1024}K" if tokens % 1024 == 0 else str(tokens)


def length_histogram(lengths: pd.DataFrame, budgets: Sequence[int]) -> pd.DataFrame:
    """Table 7: prompts per subtask below, between and above the sorted `budgets`, with the total."""
    edges = sorted(budgets)
    labels = ([f"< {_kilo(edges[0])}"] + [f"{_kilo(a)}-{_kilo(b)}" for a, b in zip(edges, edges[1:])]
              + [f">= {_kilo(edges[-1])}"])
    bins = pd.cut(lengths["prompt_tokens"], [float("-inf"), *edges, float("inf")], right=False, labels=labels)
    table = pd.crosstab([lengths["model"], lengths["subtask"]], bins).reindex(columns=labels, fill_value=0)
    table["total"] = table.sum(axis=1)
    return table.reset_index().rename_axis(columns=None)


def compression_ratios(lengths: pd.DataFrame, budgets: Sequence[int]) -> pd.DataFrame:
    """Table 8: per subtask, the mean of min(1, B / L_i) for each budget B; per model an `average` row, the mean
    over its subtasks (the paper's)."""
    out = lengths[["model", "subtask"]].copy()
    columns = [_kilo(b) for b in sorted(budgets)]
    for budget, column in zip(sorted(budgets), columns):
        out[column] = (budget / lengths["prompt_tokens"]).clip(upper=1.0)
    table = out.groupby(["model", "subtask"], sort=True)[columns].mean().reset_index()
    averages = table.groupby("model")[columns].mean().reset_index().assign(subtask="average")
    return pd.concat([table, averages[table.columns]], ignore_index=True)


def length_figure(lengths: pd.DataFrame, budgets: Sequence[int]) -> plt.Figure:
    """Fig. 18: a box of each subtask's prompt lengths (one panel per model), the budgets as dashed lines."""
    models = sorted(lengths["model"].unique())
    fig, axes = plt.subplots(len(models), 1, figsize=(11, 3.6 * len(models)), squeeze=False)
    for ax, model in zip(axes[:, 0], models):
        rows = lengths[lengths["model"] == model]
        names = sorted(rows["subtask"].unique())
        ax.boxplot([rows[rows["subtask"] == name]["prompt_tokens"] for name in names])
        ax.set_xticks(range(1, len(names) + 1), names, rotation=45, ha="right", fontsize=8)
        for budget in budgets:
            ax.axhline(budget, color="grey", linestyle="--", linewidth=0.8)
        ax.set_yscale("log")
        ax.set_ylabel("prompt length (tokens)")
        ax.set_title(f"{model}: prompt lengths; dashed: the budgets {', '.join(_kilo(b) for b in sorted(budgets))}",
                     fontsize=9)
    fig.tight_layout()
    return fig
