"""Paper layouts from records (kvbench/reporting/): the expected grid, missing points shown as missing,
suite and category means, deltas from the reference, and the files a report writes."""

from __future__ import annotations

from pathlib import Path

import matplotlib.image
import pandas as pd
import pytest

from kvbench.cli.report import main
from kvbench.core.errors import KVBenchError
from kvbench.reporting.paper import build
from kvbench.reporting.paper_figures import accuracy_figure
from kvbench.reporting.paper_tables import (
    MISSING,
    ReportSpec,
    Source,
    expected_grid,
    main_table,
    missing_points,
    point_scores,
    resolve,
)
from kvbench.reporting.preset_points import norm, select_points
from kvbench.reporting.uncertainty import NOT_PAIRED
from kvbench.results.collect import collect, load
from kvbench.results.store import RecordStore, point_hash


def write_point(root: Path, method: str, budget, scores: dict[str, list[float]], *, task: str = "suite",
                model: str = "m", compress_question: bool = True, kept=None, meta=None, dtype=None,
                reads: float | None = None, seq_len: int = 2048) -> None:
    point = {"model": model, "task": task, "method": method, "budget": None if method == "full" else budget,
             "compress_question": compress_question, "seq_len": seq_len, **({"dtype": dtype} if dtype else {})}
    run_dir = root / f"{model}-{task}-{method}-{budget}-{compress_question}{dtype or ''}-{seq_len}"
    (run_dir / ".").mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(f"method:\n  name: {method}\n  window: 32\ntask:\n  name: {task}\n"
                                         f"budget: {budget}\n")
    store = RecordStore(run_dir)
    for subtask, values in scores.items():
        for i, score in enumerate(values):
            store.append({"sample_id": f"{subtask}-{i}", "task": subtask, "score": score, "point": point,
                          "point_hash": point_hash(point), "turns": [{"score": score}],
                          **({"kept_tokens_per_head": kept} if kept is not None else {}),
                          **({"decode_read_tokens_per_group": reads + i} if reads is not None else {}),
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


def test_context_length_columns_from_a_swept_task_seq_len(tmp_path: Path) -> None:
    """CTKVR Table 1's layout: methods x budgets as rows, the swept context lengths as columns."""
    for seq_len, score in ((1024, 1.0), (2048, 0.5)):
        write_point(tmp_path, "full", None, {"a": [score]}, seq_len=seq_len)
    write_point(tmp_path, "snapkv", 64, {"a": [0.0]}, seq_len=1024)
    grid = expected_grid({"method": "full,snapkv", "budget": "64", "task.seq_len": "1024,2048"},
                         {"model": "m", "task": "suite", "method": "full", "budget": 64, "compress_question": True})
    points, subtasks = point_scores(collect(tmp_path))
    spec = {"x": "seq_len", "rows": ("method", "budget")}
    table = main_table(source(tmp_path, grid, **spec), points, subtasks).set_index("method")
    assert list(table.columns)[-2:] == ["1024", "2048"] and len(table) == 2  # one row per method, not per length
    assert table.loc["full", "1024"] == pytest.approx(100.0) and table.loc["full", "2048"] == pytest.approx(50.0)
    assert table.loc["snapkv", "1024"] == pytest.approx(0.0) and table.loc["snapkv", "2048"] == MISSING


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


def test_a_sparse_comparison_also_draws_scores_against_the_measured_reads(tmp_path: Path) -> None:
    """Issue 21: the papers' budget axes count differently, so a report with a sparse method draws a second
    figure at equal traffic: x is each point's mean K/V tokens read per KV group and step."""
    results = tmp_path / "results"
    write_point(results, "full", None, {"niah": [1.0, 1.0]}, reads=2000)
    for budget in (64, 128):
        write_point(results, "quest", budget, {"niah": [0.0, 1.0]}, reads=budget)
        write_point(results, "exact_topk", budget, {"niah": [1.0, 1.0]}, reads=3 * budget)  # per query head
    out = build(results, tmp_path / "report")
    shape, drawn = _drawn(out["figures"]["accuracy_equal_traffic"])
    assert shape[1] >= 800 and 0.02 < drawn < 0.95
    reads = out["points"].set_index(["method", "budget"])["read_tokens"]
    assert reads[("exact_topk", 128)] == 3 * 128 + 0.5 and reads[("quest", 64)] == 64.5  # the mean over samples
    # an eviction-only comparison keeps its one figure: its budget is what it keeps and reads
    write_point(tmp_path / "eviction", "snapkv", 64, {"niah": [1.0]}, reads=64)
    assert "accuracy_equal_traffic" not in build(tmp_path / "eviction", tmp_path / "r2")["figures"]


def test_load_flattens_the_run_config_into_columns(tmp_path: Path) -> None:
    write_point(tmp_path, "snapkv", 64, {"a": [1.0]})
    df = load(tmp_path)
    assert df.loc[0, "method.window"] == 32 and df.loc[0, "method"] == "snapkv" and df.loc[0, "subtask"] == "a"
    with pytest.raises(Exception, match="neither a results directory nor an experiment"):
        load(tmp_path / "nope")
    assert df.attrs["point_columns"][:3] == ["model", "task", "method"]


def test_load_reads_results_stored_elsewhere_and_says_where_it_looked(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    stored = tmp_path / "elsewhere"
    write_point(stored, "snapkv", 64, {"a": [1.0]})
    monkeypatch.chdir(tmp_path)  # the preset's results_dir (relative) holds nothing here
    assert list(load("demo", results_dir=stored)["method"]) == ["snapkv"]
    with pytest.raises(KVBenchError, match=r"no records under results \(.*relative to the current directory\); "
                                           r"pass load\('demo', results_dir=\.\.\.\)") as err:
        load("demo")
    assert str(tmp_path / "results") in str(err.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(KVBenchError, match="no records under"):
        load(tmp_path / "empty")


def test_two_dtypes_split_a_row_and_hidden_differences_refuse_a_cell(tmp_path: Path) -> None:
    write_point(tmp_path, "snapkv", 64, {"a": [1.0]}, dtype="float32")
    write_point(tmp_path, "snapkv", 64, {"a": [0.0]}, dtype="bfloat16")
    points, subtasks = point_scores(collect(tmp_path))
    table = main_table(source(tmp_path, rows=("method",)), points, subtasks)
    assert list(table.columns) == ["method", "dtype", "64"]  # dtype became a row field: never a 50.0 average
    assert dict(zip(table["dtype"], table["64"])) == {"bfloat16": 0.0, "float32": 100.0}
    point = {"model": "m", "task": "suite", "method": "snapkv", "budget": 64, "compress_question": True,
             "seq_len": 2048, "dtype": "float32"}
    RecordStore(tmp_path / "other_engine").append({"sample_id": "a-0", "task": "a", "score": 0.5, "point": point,
                                                   "point_hash": point_hash({**point, "engine": "x"})})
    points, subtasks = point_scores(collect(tmp_path))
    with pytest.raises(KVBenchError, match="would share one cell"):
        main_table(source(tmp_path, rows=("method",)), points, subtasks)


# adakv_fig4_cpu on the tiny model, snapkv and the reference at one budget, question-aware only
PRESET = ["model=tiny_llama", "method=full,snapkv", "budget=0.2", "compress_question=true"]


def write_preset_point(root: Path, name: str, overrides: list[str], score: float | list[float],
                       **manifest_model) -> None:
    """A point directory as a run of adakv_fig4_cpu with `overrides` leaves it: records (one per score, samples
    s0, s1, ...), and the manifest's identity (`point_identity` of the composed config), its model fields
    replaced by `manifest_model`."""
    import json

    from kvbench.config.paths import experiment_config
    from kvbench.run.identity import point_identity

    cfg = experiment_config("adakv_fig4_cpu", overrides)
    identity = point_identity(cfg)
    identity["model"].update(manifest_model)
    (root / name).mkdir(parents=True)
    (root / name / "manifest.json").write_text(json.dumps({"point": identity, "point_hash": point_hash(identity)}))
    point = {"model": cfg.model.name, "task": cfg.task.name, "method": cfg.method.name, "budget": cfg.budget,
             "seq_len": cfg.task.seq_len, "compress_question": True, "dtype": "float32", "seed": 42}
    for i, value in enumerate(score if isinstance(score, list) else [score]):
        RecordStore(root / name).append({"sample_id": f"s{i}", "task": "ruler_niah_single_2", "score": value,
                                         "sample_digest": f"d{i}", "point": point,
                                         "point_hash": point_hash(identity)})


def test_preset_report_leaves_out_points_of_other_settings_and_says_so(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    results = tmp_path / "results"
    tiny = ["model=tiny_llama", "compress_question=true", "budget=0.2"]
    write_preset_point(results, "full", [*tiny, "method=full"], 1.0)
    write_preset_point(results, "snapkv", [*tiny, "method=snapkv"], 0.5)
    # the same results_dir also holds a 1K one-sample run and a block-wise SnapKV: other points, not these cells
    write_preset_point(results, "snapkv_1k", [*tiny, "method=snapkv", "task.seq_len=1024", "task.num_samples=1"], 0.0)
    write_preset_point(results, "snapkv_block", [*tiny, "method=snapkv", "method.block_size=128"], 0.0)
    write_preset_point(results, "snapkv_bf16", [*tiny, "method=snapkv"], 0.0, dtype="bfloat16")
    src = resolve("experiment=adakv_fig4_cpu", [*PRESET, f"results_dir={results}"])
    df, left_out = select_points(src, collect(results))
    assert sorted(df["run_dir"].unique()) == ["full", "snapkv"]
    assert dict(left_out) == {"snapkv_1k": ["task.num_samples=1 vs 3", "task.seq_len=1024 vs 2048"],
                              "snapkv_block": ["method.block_size=128 vs unset"],
                              "snapkv_bf16": ["model.dtype=bfloat16 vs float32"]}  # tiny_llama pins float32

    assert main(["experiment=adakv_fig4_cpu", *PRESET, f"results_dir={results}", "--out", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    assert "left out 3 points whose settings differ from the preset:\n" in out
    assert "  snapkv_1k (task.num_samples=1 vs 3, task.seq_len=1024 vs 2048)\n" in out
    table = pd.read_csv(tmp_path / "r" / "table.csv").set_index("method")
    assert table.loc["snapkv", "0.2"] == pytest.approx(50.0)  # the 0.0 scores of the others are not in it
    page = (tmp_path / "r" / "index.html").read_text()
    assert "left out 3 points whose settings differ from the preset" in page and "method.block_size=128" in page


def test_a_preset_dtype_left_to_the_machine_matches_what_each_machine_resolved(tmp_path: Path) -> None:
    """smollm2_135m says dtype and device `auto`: a point a GPU node ran in bfloat16 is the preset's point, as
    is one a CPU ran in float32; their dtype is shown (and splits rows), not matched."""
    smollm = ["compress_question=true", "budget=0.2", "method=snapkv"]
    write_preset_point(tmp_path, "gpu", smollm, 1.0, dtype="bfloat16", device="cuda")
    write_preset_point(tmp_path, "cpu", [*smollm, "seed=1"], 1.0, dtype="float32", device="cpu")
    src = resolve("experiment=adakv_fig4_cpu", ["method=snapkv", "budget=0.2", "compress_question=true",
                                                f"results_dir={tmp_path}"])
    df, left_out = select_points(src, collect(tmp_path))
    assert list(df["run_dir"]) == ["gpu"] and dict(left_out) == {"cpu": ["seed=1 vs 42"]}


def test_a_preset_report_carries_intervals_and_paired_comparisons(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """adakv_fig4_cpu's report (issue 38): each cell's n and interval in the CSV and on the page, each method
    against Full and Ada-KV against SnapKV over their 20 shared samples, error bars in the figure, the same
    numbers on a second run. SnapKV misses 6 of Full's 20: its mean difference resamples as -Binomial(20, 0.3)
    / 20, 95% interval [-50, -10]: distinguishable. Ada-KV gets 2 more right than SnapKV: Binomial(20, 0.1) /
    20, [0, 25]: not distinguishable."""
    results = tmp_path / "results"
    tiny = ["model=tiny_llama", "compress_question=true", "budget=0.2"]
    full, snap = [1.0] * 20, [0.0] * 6 + [1.0] * 14
    write_preset_point(results, "full", [*tiny, "method=full"], full)
    write_preset_point(results, "snapkv", [*tiny, "method=snapkv"], snap)
    write_preset_point(results, "adakv", [*tiny, "method=adakv"], [1.0, 1.0] + snap[2:])
    write_preset_point(results, "pyramidkv", [*tiny, "method=pyramidkv"], [0.0])  # one sample: no interval
    argv = ["experiment=adakv_fig4_cpu", "model=tiny_llama", "method=full,snapkv,adakv,pyramidkv", "budget=0.2",
            "compress_question=true", f"results_dir={results}", "--out", str(tmp_path / "r")]
    assert main(argv) == 0
    assert "a paired difference of" in capsys.readouterr().out  # the detectable difference, printed
    table = pd.read_csv(tmp_path / "r" / "table.csv").set_index("method")
    assert (table.loc["snapkv", "0.2"], table.loc["snapkv", "0.2 n"]) == (pytest.approx(70.0), 20)
    assert table.loc["full", ["0.2 ci_low", "0.2 ci_high"]].tolist() == [100.0, 100.0]
    assert table.loc["pyramidkv", "0.2 n"] == 1 and table.loc["pyramidkv", ["0.2 ci_low", "0.2 ci_high"]].isna().all()
    pairs = pd.read_csv(tmp_path / "r" / "comparisons.csv").set_index(["method", "against"])
    assert pairs.loc[("snapkv", "full"), ["n_shared", "difference", "ci_low", "ci_high"]].tolist() == [
        20, pytest.approx(-30.0), -50.0, -10.0]
    assert pairs.loc[("snapkv", "full"), "result"] == "distinguishable"
    assert pairs.loc[("adakv", "snapkv"), ["difference", "ci_low", "ci_high"]].tolist() == [
        pytest.approx(10.0), 0.0, 25.0]
    assert pairs.loc[("adakv", "snapkv"), "result"] == "not distinguishable"
    assert pairs.loc[("pyramidkv", "full"), "result"].startswith("no interval")
    page = (tmp_path / "r" / "index.html").read_text()
    assert "title='95% CI [50.0, 90.0], n=20'" in page  # SnapKV's 14 of 20: Binomial(20, 0.7)'s 10 and 18
    assert "Paired comparisons" in page and "not distinguishable" in page and "n=1" in page
    assert "95\\% bootstrap intervals" in (tmp_path / "r" / "table.tex").read_text()  # the second LaTeX table
    first = {name: (tmp_path / "r" / name).read_bytes() for name in ("table.csv", "comparisons.csv", "points.csv")}
    assert main(argv) == 0  # seeded: a second report writes the same numbers
    assert first == {name: (tmp_path / "r" / name).read_bytes() for name in first}

    from matplotlib.collections import LineCollection

    src = resolve("experiment=adakv_fig4_cpu", argv[1:-2])
    points, _ = point_scores(select_points(src, collect(results))[0])
    fig = accuracy_figure(src, points)
    bars = [c for ax in fig.axes for c in ax.collections if isinstance(c, LineCollection)]
    assert len(bars) == 2  # snapkv's and adakv's error bars; pyramidkv's one sample has none, not a flat one
    snap_span, ada_span = sorted(tuple(bar.get_segments()[0][:, 1]) for bar in bars)
    assert snap_span == (50.0, 90.0) and ada_span[0] < 80.0 < ada_span[1]


def test_pairs_need_shared_samples_and_never_cross_a_dtype(tmp_path: Path) -> None:
    dtypes, other = tmp_path / "dtypes", tmp_path / "other_samples"
    write_point(dtypes, "full", None, {"a": [1.0, 1.0]}, dtype="float32")
    write_point(dtypes, "snapkv", 64, {"a": [1.0, 0.0]}, dtype="float32")
    write_point(dtypes, "snapkv", 64, {"a": [0.0, 0.0]}, dtype="bfloat16")  # no bfloat16 Full to pair with
    write_point(other, "full", None, {"a": [1.0, 1.0]})  # SnapKV's cell ran on other prompts than Full's
    write_point(other, "snapkv", 64, {"b": [1.0, 0.0]})
    pairs = build(dtypes, tmp_path / "r")["stats"]["comparisons"]
    assert pairs[["method", "dtype", "n_shared"]].values.tolist() == [["snapkv", "float32", 2]]
    assert build(other, tmp_path / "r2")["stats"]["comparisons"]["result"].tolist() == [NOT_PAIRED]


def test_a_category_average_weighs_its_subtasks_like_the_number_it_shows(tmp_path: Path) -> None:
    """CTKVR's AVG is the mean of category means: qa1 and qa2 weigh 1/4 each, code 1/2; its interval (and in a
    delta table, the paired difference's) resamples with those weights."""
    write_point(tmp_path, "full", None, {"qa1": [1.0, 1.0], "qa2": [1.0, 1.0], "code": [1.0, 1.0]})
    write_point(tmp_path, "snapkv", 64, {"qa1": [1.0, 1.0], "qa2": [1.0, 1.0], "code": [0.0, 1.0]})
    spec = {"columns": "category", "categories": {"QA": ["qa1", "qa2"], "Code": ["code"]}, "rows": ("method",),
            "delta": True}
    out = build(source(tmp_path, **spec), tmp_path / "r")
    table = pd.read_csv(tmp_path / "r" / "table.csv").set_index("method")
    # code's difference resamples to 0, -50 or -100 (1/4, 1/2, 1/4), halved in the average: [-50, 0]
    assert table.loc["snapkv", ["avg", "avg ci_low", "avg ci_high"]].tolist() == [-25.0, -50.0, 0.0]
    assert table.loc["snapkv", ["Code", "Code ci_low", "Code ci_high"]].tolist() == [-50.0, -100.0, 0.0]
    assert out["stats"]["detectable"] is not None and out["stats"]["detectable"].comparisons == 1


@pytest.mark.parametrize(("preset", "points", "labels"), [
    ("adakv_fig4_cpu", 42, ["compress_question", "method"]),  # one column per budget
    ("ctkvr_table4_cpu", 4, ["method.centroid_positions", "method"]),  # one column per subtask
])
def test_a_preset_with_no_records_yet_reports_every_point_missing(tmp_path: Path, capsys, preset, points,
                                                                  labels) -> None:
    """Before its sweep has written anything, a preset's report is its grid, every cell `missing` (not a crash),
    and the exit status says there were no records."""
    results = tmp_path / "results"
    results.mkdir()
    assert main([f"experiment={preset}", f"results_dir={results}", "--out", str(tmp_path / "r")]) == 1
    assert f"{points} expected points have no records" in capsys.readouterr().out
    table = pd.read_csv(tmp_path / "r" / "table.csv")
    assert len(table) and (table.drop(columns=labels) == MISSING).all().all()


def test_turn_columns_show_a_conversation_s_accuracy_per_round(tmp_path: Path) -> None:
    """`columns: turn` (CTKVR Table 5): a column per round holding the mean of that turn's scores over the
    conversations, the average over rounds, and an interval per round from resampling conversations."""
    point = {"model": "m", "task": "mt", "method": "ctkvr", "budget": 64, "compress_question": True, "seq_len": 2048}
    store = RecordStore(tmp_path / "ctkvr")
    rounds = [[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 1.0]]  # four conversations, three turns
    for i, turns in enumerate(rounds):
        store.append({"sample_id": f"mt-{i}", "task": "mt", "score": sum(turns) / 3, "point": point,
                      "point_hash": point_hash(point), "turns": [{"score": t} for t in turns]})
    build(source(tmp_path, columns="turn", rows=("method",)), tmp_path / "r")
    table = pd.read_csv(tmp_path / "r" / "table.csv").set_index("method")
    assert [c for c in table.columns if c.startswith("round") and c.count(" ") == 1] == ["round 1", "round 2",
                                                                                        "round 3"]
    assert table.loc["ctkvr", ["round 1", "round 2", "round 3"]].tolist() == [100.0, 50.0, 50.0]
    assert table.loc["ctkvr", "avg"] == pytest.approx(200 / 3)
    assert table.loc["ctkvr", "round 1 n"] == 4 and table.loc["ctkvr", "round 2 ci_low"] < 50.0


def test_an_x_of_names_draws_one_evenly_spaced_tick_per_name(tmp_path: Path) -> None:
    """A swept setting whose values are names (CTKVR's centroid rules) is the figure's x as categories."""
    for rule, scores in (("init", [0.0, 1.0]), ("final", [1.0, 1.0]), ("equi", [1.0, 0.0])):
        write_point(tmp_path, "ctkvr", 64, {"a": scores}, task=rule)
    src = source(tmp_path, x="task", panels=("model",))
    points, _ = point_scores(select_points(src, collect(tmp_path))[0])
    ax = accuracy_figure(src, points).axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["equi", "final", "init"]
    line = next(line for line in ax.get_lines() if line.get_label() == "ctkvr")
    assert list(line.get_xdata()) == [0.0, 1.0, 2.0] and list(line.get_ydata()) == [50.0, 100.0, 50.0]


def test_a_single_value_of_a_swept_method_setting_narrows_the_reports_grid() -> None:
    """`kvbench report experiment=X method.block_size=64` where X sweeps `method.block_size: 64,256`: the grid
    keeps the 64 points (the setting composes as a run's does, although the preset's base method lacks it)."""
    whole = resolve("experiment=keydiff_table12_cpu", [])
    narrowed = resolve("experiment=keydiff_table12_cpu", ["method.block_size=64"])
    assert {p["method.block_size"] for p in whole.grid} == {"64", "256"}
    assert {p["method.block_size"] for p in narrowed.grid} == {"64"} and 2 * len(narrowed.grid) == len(whole.grid)


def test_reports_of_sampled_responses_say_their_intervals_resample_problems(tmp_path: Path) -> None:
    """Issue 65: KeyDiff's math table and an accuracy table over Math-500's records (3 sampled responses per
    problem, one point all right, one right on 2 of 4 problems) say that their intervals resampled problems;
    the interval is the one over the 4 problems, and the detectable difference counts problems."""
    results = tmp_path / "results"
    meta = [{"unique_id": f"p{i // 3}", "samples_per_problem": 3} for i in range(12)]
    write_point(results, "full", None, {"math500": [1.0] * 12}, task="math500", meta=meta)
    write_point(results, "snapkv", 64, {"math500": [float(i // 3 % 2) for i in range(12)]}, task="math500",
                meta=meta)
    unit = "problems (each with its 3 sampled responses; n counts responses)"
    math = build(source(results, kind="math", rows=("method", "budget")), tmp_path / "math")
    table = math["table"].set_index("method")
    assert table.loc["snapkv", ["n", "flex_match_ci_low", "flex_match_ci_high"]].tolist() == [12, 0.0, 1.0]
    note = f"flex_match_ci_low, flex_match_ci_high: the 95% bootstrap interval of flex_match over {unit}"
    assert note in (tmp_path / "math" / "report.md").read_text()
    assert note in (tmp_path / "math" / "index.html").read_text()
    accuracy = build(source(results, rows=("model", "task", "method")), tmp_path / "accuracy")
    caption = f"95% bootstrap intervals over {unit} (stratified by subtask)"
    for name in ("report.md", "index.html", "table.tex"):
        assert caption in (tmp_path / "accuracy" / name).read_text().replace("95\\%", "95%"), name
    assert "median 4 problems per subtask" in (tmp_path / "accuracy" / "report.md").read_text()
    assert accuracy["stats"]["detectable"].samples_per_subtask == 4
    # a task without problems: the caption over samples, as the committed reports have it
    write_point(tmp_path / "plain", "full", None, {"niah": [1.0, 0.0, 1.0]})
    build(source(tmp_path / "plain"), tmp_path / "plain_report")
    text = (tmp_path / "plain_report" / "report.md").read_text()
    assert "95% bootstrap intervals over samples (stratified by subtask) and sample counts" in text
    assert "problems" not in text
