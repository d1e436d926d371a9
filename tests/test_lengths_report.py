"""KeyDiff App. F.3 from a sweep's records (`reporting.lengths`, `report.length_statistics`): prompts per length
range (Table 7), the average compression ratio mean(min(1, B / L)) per budget with the subtasks' mean (Table 8),
the lengths per subtask (Fig. 18); each prompt counted once however many points ran it."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from kvbench.reporting.lengths import compression_ratios, length_histogram, prompt_lengths
from kvbench.reporting.paper import build
from kvbench.reporting.paper_tables import ReportSpec, Source
from kvbench.results.store import RecordStore, point_hash

LENGTHS = {"qa": [1000, 3000, 5000, 9000], "code": [2048, 8192]}


def records(methods=("full", "snapkv"), budgets=(2048, 4096)) -> pd.DataFrame:
    rows = []
    for method in methods:
        for budget in budgets if method != "full" else (None,):
            for subtask, lengths in LENGTHS.items():
                rows += [{"model": "m", "method": method, "budget": budget, "subtask": subtask, "sample_id": f"{subtask}{i}",
                          "prompt_tokens": length} for i, length in enumerate(lengths)]
    return pd.DataFrame(rows)


def test_each_prompt_counts_once_and_falls_in_its_range():
    lengths = prompt_lengths(records())
    assert len(lengths) == 6  # three points ran each prompt
    table = length_histogram(lengths, [4096, 2048]).set_index("subtask")
    assert list(table.columns) == ["model", "< 2K", "2K-4K", ">= 4K", "total"]
    assert table.loc["qa", ["< 2K", "2K-4K", ">= 4K", "total"]].tolist() == [1, 1, 2, 4]
    assert table.loc["code", ["< 2K", "2K-4K", ">= 4K", "total"]].tolist() == [0, 1, 1, 2]  # a budget opens its range


def test_the_compression_ratio_is_the_mean_of_min_one_and_the_subtasks_mean_is_the_average():
    table = compression_ratios(prompt_lengths(records()), [2048, 4096]).set_index("subtask")
    qa_2k = (1 + 2048 / 3000 + 2048 / 5000 + 2048 / 9000) / 4  # a prompt within the budget counts 1
    assert table.loc["qa", "2K"] == pytest.approx(qa_2k)
    assert table.loc["code", "4K"] == pytest.approx((1 + 4096 / 8192) / 2)
    assert table.loc["average", "2K"] == pytest.approx((qa_2k + (1 + 0.25) / 2) / 2)  # over subtasks, not prompts


def test_a_report_with_length_statistics_writes_tables_7_8_and_figure_18(tmp_path: Path):
    for (method, budget), rows in records().groupby(["method", "budget"], dropna=False):
        point = {"model": "m", "task": "suite", "method": method, "budget": None if pd.isna(budget) else int(budget),
                 "compress_question": True, "seq_len": 9000}
        store = RecordStore(tmp_path / "points" / f"{method}-{budget}")
        for row in rows.to_dict("records"):
            store.append({"sample_id": row["sample_id"], "task": row["subtask"], "score": 1.0, "point": point,
                          "point_hash": point_hash(point), "turns": [{"score": 1.0}],
                          "prompt_tokens": row["prompt_tokens"]})
    spec = ReportSpec(title="t", rows=("method",), columns="subtask", length_statistics=True)
    build(Source("t", tmp_path / "points", spec, None), tmp_path / "r")
    shown = pd.read_csv(tmp_path / "r" / "compression_ratio.csv").set_index("subtask")
    assert list(shown.columns) == ["model", "2K", "4K"] and shown.loc["code", "4K"] == 0.75
    assert pd.read_csv(tmp_path / "r" / "prompt_lengths.csv")["total"].sum() == 6
    assert (tmp_path / "r" / "prompt_lengths.png").stat().st_size > 5000
    report = (tmp_path / "r" / "report.md").read_text()
    assert "KeyDiff Table 8" in report and "prompt_lengths.png" in report
    assert "KeyDiff Fig. 18" in (tmp_path / "r" / "index.html").read_text()
