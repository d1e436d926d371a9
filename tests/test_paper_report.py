"""Paper layouts from records (kvbench/reporting/): the expected grid, missing points shown as missing,
suite and category means, deltas from the reference, and the files a report writes."""

from __future__ import annotations

from pathlib import Path

import matplotlib.image
import pandas as pd
import pytest

from kvbench.reporting.paper import build
from kvbench.reporting.paper_tables import (
    MISSING,
    ReportSpec,
    Source,
    expected_grid,
    main_table,
    missing_points,
    norm,
    point_scores,
)
from kvbench.results.collect import collect, load
from kvbench.results.store import RecordStore, point_hash


def write_point(root: Path, method: str, budget, scores: dict[str, list[float]], *, task: str = "suite",
                model: str = "m", compress_question: bool = True, kept=None, meta=None) -> None:
    point = {"model": model, "task": task, "method": method, "budget": None if method == "full" else budget,
             "compress_question": compress_question, "seq_len": 2048}
    run_dir = root / f"{model}-{task}-{method}-{budget}-{compress_question}"
    (run_dir / ".").mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(f"method:\n  name: {method}\n  window: 32\ntask:\n  name: {task}\n"
                                         f"budget: {budget}\n")
    store = RecordStore(run_dir)
    for subtask, values in scores.items():
        for i, score in enumerate(values):
            store.append({"sample_id": f"{subtask}-{i}", "task": subtask, "score": score, "point": point,
                          "point_hash": point_hash(point), "turns": [{"score": score}],
                          **({"kept_tokens_per_head": kept} if kept is not None else {}),
                          **({"meta": meta[i]} if meta is not None else {})})


def source(root: Path, grid=None, **spec) -> Source:
    return Source("t", root, ReportSpec(title="t", **spec), grid)


def test_expected_grid_collapses_budget_for_methods_without_one() -> None:
    grid = expected_grid({"method": "full,snapkv", "budget": "64,128", "compress_question": "true,false"},
                            {"model": "m", "task": "suite", "method": "full", "budget": 1024, "compress_question": True})
    assert len(grid) == 2 + 4  # full once per mode, snapkv per budget and mode
    assert {p["budget"] for p in grid if p["method"] == "full"} == {"-"}
    assert {p["budget"] for p in grid if p["method"] == "snapkv"} == {"64", "128"}
    assert norm(64) == norm("64") == norm(64.0) == "64" and norm(True) == norm("true") == "true"


def test_budget_table_suite_mean_and_missing_cells(tmp_path: Path) -> None:
    write_point(tmp_path, "full", None, {"a": [1.0, 1.0], "b": [1.0]})
    write_point(tmp_path, "snapkv", 64, {"a": [1.0, 0.0], "b": [1.0]})  # a: 50, b: 100 -> suite mean 75
    grid = expected_grid({"method": "full,snapkv", "budget": "64,128"},
                            {"model": "m", "task": "suite", "method": "full", "budget": 64, "compress_question": True})
    points, subtasks = point_scores(collect(tmp_path))
    table = main_table(source(tmp_path, grid, rows=("method",)), points, subtasks).set_index("method")
    assert list(table.columns) == ["64", "128"]
    assert table.loc["snapkv", "64"] == pytest.approx(75.0)  # the unweighted subtask mean, not 66.7
    assert table.loc["snapkv", "128"] == MISSING  # expected, never recorded: missing, not zero
    assert table.loc["full", "64"] == table.loc["full", "128"] == pytest.approx(100.0)
    assert missing_points(points, grid) == [{"model": "m", "task": "suite", "method": "snapkv", "budget": "128",
                                                "compress_question": "true"}]


def test_subtask_and_category_tables_with_delta(tmp_path: Path) -> None:
    write_point(tmp_path, "full", None, {"qa1": [1.0], "qa2": [0.5], "code": [1.0]})
    write_point(tmp_path, "snapkv", 64, {"qa1": [0.0], "qa2": [0.5], "code": [1.0]})
    points, subtasks = point_scores(collect(tmp_path))
    per_task = main_table(source(tmp_path, columns="subtask", rows=("method",)), points, subtasks)
    assert list(per_task.columns) == ["method", "qa1", "qa2", "code", "avg"]
    snap = per_task.set_index("method").loc["snapkv"]
    assert (snap["qa1"], snap["qa2"], snap["code"], snap["avg"]) == pytest.approx((0.0, 50.0, 100.0, 50.0))
    spec = {"columns": "category", "categories": {"QA": ["qa1", "qa2"], "Code": ["code"], "Summ": ["gov_report"]},
            "rows": ("method",), "delta": True}
    cats = main_table(source(tmp_path, **spec), points, subtasks).set_index("method")
    assert cats.loc["full", "QA"] == pytest.approx(75.0) and cats.loc["full", "avg"] == pytest.approx(87.5)
    assert cats.loc["snapkv", "QA"] == pytest.approx(-50.0) and cats.loc["snapkv", "Code"] == pytest.approx(0.0)
    assert "Summ" not in cats.columns  # a category without any recorded subtask has no column


def _drawn(png: Path) -> tuple[tuple[int, ...], float]:
    pixels = matplotlib.image.imread(png)
    return pixels.shape, float((pixels[..., :3] < 0.95).any(axis=-1).mean())


def test_build_writes_tables_figures_and_one_html_page(tmp_path: Path) -> None:
    results = tmp_path / "results"
    cells = [{"length": n, "depth": d} for n in (1024, 2048) for d in (0, 50, 100)]
    write_point(results, "full", None, {"niah": [1.0] * 6}, meta=cells)
    for budget, score in ((64, 0.0), (128, 0.5)):
        write_point(results, "snapkv", budget, {"niah": [score] * 6}, meta=cells)
        write_point(results, "adakv", budget, {"niah": [score] * 6}, meta=cells, kept=[[budget - 8, budget + 8]])
    out = build(results, tmp_path / "report")
    assert {p.name for p in out["written"]} >= {"accuracy.png", "accuracy.pdf", "niah_heatmap.png",
                                                 "kept_tokens.png", "table.csv", "table.md", "table.tex",
                                                 "index.html", "report.md", "points.csv"}
    for name in ("accuracy", "niah_heatmap", "kept_tokens"):
        shape, drawn = _drawn(out["figures"][name])
        assert shape[0] >= 400 and shape[1] >= 800 and 0.02 < drawn < 0.95, name
    table = pd.read_csv(tmp_path / "report" / "table.csv")
    assert list(table["method"]) == ["full", "adakv", "snapkv"]  # the reference first
    assert "\\begin{tabular}" in (tmp_path / "report" / "table.tex").read_text()
    page = (tmp_path / "report" / "index.html").read_text()
    assert page.count("data:image/png;base64,") == 3 and "<table" in page


def test_load_flattens_the_run_config_into_columns(tmp_path: Path) -> None:
    write_point(tmp_path, "snapkv", 64, {"a": [1.0]})
    df = load(tmp_path)
    assert df.loc[0, "method.window"] == 32 and df.loc[0, "method"] == "snapkv" and df.loc[0, "subtask"] == "a"
    with pytest.raises(Exception, match="neither a results directory nor an experiment"):
        load(tmp_path / "nope")
    assert df.attrs["point_columns"][:3] == ["model", "task", "method"]
