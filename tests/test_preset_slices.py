"""The `_cpu` twins of the presets that only lacked a config (issue 46, item 3), each run end to end on the embedded
SmolLM2 as a user would (`tests/preset_slice.py`: the sweep, then `kvbench report experiment=...`), narrowed to a
slice that takes about a minute: one budget, two values of a swept setting, one short RULER task (or two NIAH
cells), one sample.

Each test checks the report's layout is the paper's: the rows are the swept setting's values (split factor,
block size, window ratio, anchor, metric, centroids, filter layers) or methods the slice ran, the columns are the
preset's (budgets, lengths, subtasks, categories), every cell is a score in [0, 100] from its one sample, and the
NIAH presets draw their length x depth heatmap, the efficiency preset its figure."""

from __future__ import annotations

from pathlib import Path

import matplotlib.image
import pandas as pd
import pytest
from preset_slice import run_preset_slice

pytestmark = pytest.mark.integration

# one short RULER task, one sample, no NLL pass: the smallest prompt every twin's methods accept
SHORT = ("task.seq_len=1024", "task.num_samples=1", "task.subtasks=[niah_single_2]", "engine.nll=false")


def _table(report: Path) -> pd.DataFrame:
    return pd.read_csv(report / "table.csv", dtype=str, keep_default_na=False)


def _scores(table: pd.DataFrame, columns: list[str]) -> None:
    """Every cell of `columns` holds a score of one sample, in [0, 100] (never missing, never blank)."""
    for column in columns:
        assert column in table.columns, f"no column {column}: {list(table.columns)}"
        cells = table[column]
        assert cells.map(lambda v: v not in ("", "missing") and 0.0 <= float(v) <= 100.0).all(), (column, list(cells))
        assert (table[f"{column} n"] == "1").all(), table[f"{column} n"].tolist()


def _drawn(png: Path) -> float:
    """The share of the image's pixels that are not white: a figure with something drawn on it."""
    pixels = matplotlib.image.imread(png)
    assert pixels.shape[0] >= 200 and pixels.shape[1] >= 300, pixels.shape
    return float((pixels[..., :3] < 0.95).any(axis=-1).mean())


@pytest.mark.parametrize(("preset", "setting", "values", "shown"), [
    ("rocketkv_fig9_cpu", "method.split", "null,0.3", ["-", "0.3"]),  # "-": the adaptive split (null)
    ("keydiff_table13_cpu", "method.window_ratio", "0.0,0.2", ["0", "0.2"]),  # 0.0 reads as 0
    ("keydiff_table14_cpu", "method.anchor", "pairwise,median", ["pairwise", "median"]),
    ("keydiff_table15_cpu", "method.metric", "cosine,euclidean", ["cosine", "euclidean"]),
])
def test_a_method_setting_swept_against_the_budget(tmp_path: Path, preset: str, setting: str, values: str,
                                                   shown: list[str]):
    budget = "64" if preset.startswith("rocketkv") else "256"
    table = _table(run_preset_slice(preset, tmp_path, *SHORT, f"budget={budget}", f"{setting}={values}"))
    assert list(table.columns[:2]) == [setting, budget], list(table.columns)  # one row per setting, budget columns
    assert sorted(table[setting]) == sorted(shown)
    _scores(table, [budget])


def test_keydiff_table12_block_sizes(tmp_path: Path):
    table = _table(run_preset_slice("keydiff_table12_cpu", tmp_path, *SHORT, "method=keydiff,tova_block",
                                    "budget=256"))  # both block sizes: `report` refuses method.block_size=64 alone
    assert list(table.columns[:3]) == ["method.block_size", "method", "256"]
    assert sorted(zip(table["method.block_size"], table["method"])) == [
        ("256", "keydiff"), ("256", "tova_block"), ("64", "keydiff"), ("64", "tova_block")]
    _scores(table, ["256"])


@pytest.mark.parametrize(("preset", "methods"), [
    ("keydiff_table9_cpu", ["h2o", "keydiff"]),  # one prompt block: no eviction-free row (full has no block setting)
    ("keydiff_table10_cpu", ["full", "keyl2norm_block"]),
])
def test_keydiff_longbench_tables_per_subtask(tmp_path: Path, preset: str, methods: list[str]):
    report = run_preset_slice(preset, tmp_path, *SHORT, f"method={','.join(methods)}", "budget=256")
    table = _table(report)
    # one budget: no budget column (a row field only where it varies)
    assert list(table.columns[:3]) == ["method", "ruler_niah_single_2", "avg"], list(table.columns)
    assert sorted(table["method"]) == sorted(methods)
    _scores(table, ["ruler_niah_single_2", "avg"])
    if preset == "keydiff_table10_cpu":  # KeyDiff Tables 7-8 from the same records: one prompt, longer than 256
        ratios = pd.read_csv(report / "compression_ratio.csv").set_index("subtask")
        assert list(ratios.index) == ["ruler_niah_single_2", "average"] and 0 < ratios.loc["average", "256"] < 1
        assert pd.read_csv(report / "prompt_lengths.csv")[">= 256"].tolist() == [1]


@pytest.mark.parametrize(("preset", "budget"), [("keydiff_fig6_cpu", "256"), ("ctkvr_fig5_cpu", "128")])
def test_niah_heatmaps(tmp_path: Path, preset: str, budget: str):
    method = "keydiff" if preset.startswith("keydiff") else "ctkvr"
    report = run_preset_slice(preset, tmp_path, f"method=full,{method}", "task.lengths=[512,1024]",
                              "task.depths=[100]", "engine.nll=false")
    table = _table(report)
    assert list(table["method"]) == ["full", method] and budget in table.columns
    assert (table[f"{budget} n"] == "2").all()  # 2 lengths x 1 depth x 1 passkey
    assert table[budget].map(lambda v: 0.0 <= float(v) <= 100.0).all()
    assert _drawn(report / "niah_heatmap.png") > 0.05  # one length x depth heatmap per method


def test_ctkvr_fig9_per_task_columns(tmp_path: Path):
    table = _table(run_preset_slice("ctkvr_fig9_cpu", tmp_path, *SHORT, "method=full,ctkvr", "budget=64"))
    assert list(table.columns[:3]) == ["method", "ruler_niah_single_2", "avg"], list(table.columns)
    assert list(table["method"]) == ["full", "ctkvr"]
    _scores(table, ["ruler_niah_single_2"])


def test_ctkvr_table6_fixed_and_dynamic_budgets(tmp_path: Path):
    table = _table(run_preset_slice("ctkvr_table6_cpu", tmp_path, *SHORT, "method=full,magicpig,ctkvr"))
    assert list(table.columns[:3]) == ["method", "budget", "1024"], list(table.columns)
    rows = sorted(zip(table["method"], table["budget"]))
    # MagicPIG's budget does not set its sparsity: its two budget points are the same run (ctkvr_table2)
    assert rows == [("ctkvr", "0.04"), ("ctkvr", "64"), ("full", "-"), ("magicpig", "0.04"), ("magicpig", "64")], rows
    _scores(table, ["1024"])


def test_ctkvr_table7_magicpig_configurations(tmp_path: Path):
    table = _table(run_preset_slice("ctkvr_table7_cpu", tmp_path, *SHORT, "method=magicpig_8_75,ctkvr"))
    assert list(table.columns[:2]) == ["method", "1024"], list(table.columns)
    assert sorted(table["method"]) == ["ctkvr", "magicpig_8_75"]
    _scores(table, ["1024"])


@pytest.mark.parametrize(("preset", "setting", "values"), [
    ("ctkvr_table14_cpu", "method.max_centroids", ["16", "64"]),
    ("ctkvr_table15_cpu", "method.retrieved_centroids", ["2", "8"]),
])
def test_ctkvr_centroid_sweeps(tmp_path: Path, preset: str, setting: str, values: list[str]):
    table = _table(run_preset_slice(preset, tmp_path, "task.seq_len=1024", "task.num_samples=1", "engine.nll=false",
                                    f"{setting}={','.join(values)}"))
    assert list(table.columns[:len(values) + 1]) == ["method", *values], list(table.columns)  # x: the setting
    assert list(table["method"]) == ["ctkvr"]
    _scores(table, values)


def test_ctkvr_table4_centroid_rules(tmp_path: Path):
    table = _table(run_preset_slice("ctkvr_table4_cpu", tmp_path, *SHORT, "method.centroid_positions=init,final"))
    assert list(table.columns[:4]) == ["method.centroid_positions", "method", "ruler_niah_single_2", "avg"], list(
        table.columns)
    assert sorted(table["method.centroid_positions"]) == ["final", "init"] and set(table["method"]) == {"ctkvr"}
    _scores(table, ["ruler_niah_single_2"])


def test_ctkvr_table5_rounds_with_and_without_dcu(tmp_path: Path):
    table = _table(run_preset_slice("ctkvr_table5_cpu", tmp_path, "task.seq_len=1536", "task.num_samples=1",
                                    "task.needles=2", "task.turns=2", "task.max_new_tokens=8", "engine.nll=false"))
    assert list(table.columns[:5]) == ["method.dcu", "method", "round 1", "round 2", "avg"], list(table.columns)
    assert sorted(table["method.dcu"]) == ["false", "true"] and set(table["method"]) == {"ctkvr"}
    _scores(table, ["round 1", "round 2"])


def test_omnikv_table8_filter_layers(tmp_path: Path):
    table = _table(run_preset_slice("omnikv_table8_cpu", tmp_path, "task.seq_len=1024", "task.num_samples=1",
                                    "task.subtasks=[niah_single_2,vt]", "engine.nll=false",
                                    "method.filter_layers=[2,4,18],[2,12,18]"))
    assert list(table.columns[:4]) == ["method.filter_layers", "Retrieval", "Aggregation", "avg"], list(table.columns)
    assert sorted(table["method.filter_layers"]) == ["[2,12,18]", "[2,4,18]"]
    _scores(table, ["Retrieval", "Aggregation"])


def test_omnikv_table14_prefill_ratios(tmp_path: Path):
    """OmniKV-prefill's r as methods (r = 1 and "all"), beside full attention, by RULER category; the twin's prompt
    chunks of 512 tokens make a 1K prompt two chunks, so the second chooses among the first's tokens."""
    table = _table(run_preset_slice("omnikv_table14_cpu", tmp_path, *SHORT,
                                    "method=full,omnikv_prefill_mem_r1,omnikv_prefill_mem_all"))
    assert list(table["method"]) == ["full", "omnikv_prefill_mem_all", "omnikv_prefill_mem_r1"]
    _scores(table, ["Retrieval"])


@pytest.mark.parametrize("preset", ["adakv_table2_cpu", "adakv_fig6_cpu"])
def test_adakv_longbench_layouts(tmp_path: Path, preset: str):
    report = run_preset_slice(preset, tmp_path, *SHORT, "method=snapkv,adakv", "budget=64", "compress_question=true")
    table = _table(report)
    assert sorted(table["method"]) == ["adakv", "snapkv"]
    if preset == "adakv_table2_cpu":  # Tables 2-5: one column per dataset, rows by budget
        assert list(table.columns[:3]) == ["method", "ruler_niah_single_2", "avg"], list(table.columns)
        _scores(table, ["ruler_niah_single_2"])
    else:  # Fig. 6: one column per budget
        assert list(table.columns[:2]) == ["method", "64"], list(table.columns)
        _scores(table, ["64"])
    pairs = pd.read_csv(report / "comparisons.csv")
    assert ("adakv", "snapkv") in set(zip(pairs["method"], pairs["against"]))


def test_adakv_fig7_efficiency(tmp_path: Path):
    report = run_preset_slice("adakv_fig7_cpu", tmp_path, "method=full,adakv", "task.seq_len=512,1024")
    table = _table(report)
    assert sorted(zip(table["method"], table["seq_len"])) == [
        ("adakv", "1024"), ("adakv", "512"), ("full", "1024"), ("full", "512")]
    assert table["decode_ms"].map(lambda v: float(v) > 0).all() and table["peak_MiB"].map(lambda v: float(v) > 0).all()
    assert _drawn(report / "omnikv_fig4.png") > 0.02  # decode latency and TTFT against context length


def test_ctkvr_table3_prefills_with_minference_before_each_method(tmp_path: Path):
    """CTKVR Table 3's twin: MInference's sparse prefill, then Full KV and CTKVR; the records say which prefill ran."""
    import json

    report = run_preset_slice("ctkvr_table3_cpu", tmp_path, *SHORT)
    table = _table(report)
    assert list(table["method"]) == ["full", "ctkvr"], list(table.columns)
    records = [json.loads(line) for path in (tmp_path / "results").rglob("records.jsonl")
               for line in path.read_text().splitlines()]
    assert len(records) == 2 and {r["point"]["prefill_attention"] for r in records} == {"minference"}
