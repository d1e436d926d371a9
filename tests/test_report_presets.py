"""A `_cpu` preset end to end: the sweep, then `kvbench report experiment=...`: the paper's rows and columns,
missing points shown as missing, and every figure a real image (opened, sized, with drawn pixels)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import matplotlib.image
import pandas as pd

# adakv_fig4_cpu shrunk to the tiny model: 6 methods x 2 budgets x 2 modes, one RULER task, one sample
SHRINK = ["model=tiny_llama", "task.num_samples=1", "task.subtasks=[niah_single_1]", "task.seq_len=4096", "engine.nll=false"]


def _drawn(png: Path) -> tuple[tuple[int, ...], float]:
    pixels = matplotlib.image.imread(png)
    return pixels.shape, float((pixels[..., :3] < 0.95).any(axis=-1).mean())


def test_adakv_fig4_cpu_sweep_and_its_report(tmp_path: Path) -> None:
    sweep = [*SHRINK, f"results_dir={tmp_path}"]
    run = subprocess.run([sys.executable, "-m", "kvbench", "-m", "experiment=adakv_fig4_cpu", *sweep,
                          "budget=0.2,0.6", "show_progress=false"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    # another run in the same results_dir, at another length: not a point of this report, and it says so
    other = subprocess.run([sys.executable, "-m", "kvbench", "experiment=adakv_fig4_cpu", *sweep, "method=snapkv",
                            "budget=0.2", "compress_question=true", "task.seq_len=2048", "show_progress=false"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert other.returncode == 0, other.stderr[-3000:]
    # the report is asked for the preset's budgets 0.2, 0.6 and 0.8: the 0.8 points were never run
    report = subprocess.run([sys.executable, "-m", "kvbench", "report", "experiment=adakv_fig4_cpu", *sweep,
                             "budget=0.2,0.6,0.8"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert report.returncode == 0, report.stderr[-3000:]
    assert "10 expected points have no records" in report.stdout  # 5 compressed methods x 2 modes at 0.8
    assert "left out 1 point whose settings differ from the preset:\n" in report.stdout
    assert "-qa-" in report.stdout and "(task.seq_len=2048 vs 4096)\n" in report.stdout
    out = tmp_path / "report"
    table = pd.read_csv(out / "table.csv", dtype=str, keep_default_na=False)
    assert list(table.columns[:5]) == ["compress_question", "method", "0.2", "0.6", "0.8"]  # the paper's layout
    assert list(table.columns[5:8]) == ["0.2 n", "0.2 ci_low", "0.2 ci_high"]  # then each column's n and interval
    assert (table["0.2 n"] == "1").all() and (table["0.2 ci_low"] == "").all()  # one sample: no interval
    pairs = pd.read_csv(out / "comparisons.csv")
    assert {("adakv", "full"), ("adakv", "snapkv"), ("ada_pyramid", "pyramidkv")} <= set(
        zip(pairs["method"], pairs["against"]))
    assert (pairs["n_shared"] == 1).all() and pairs["result"].str.startswith("no interval").all()
    methods = ["full", "ada_pyramid", "adakv", "pyramidkv", "snapkv", "streamingllm"]
    assert list(table["method"]) == methods * 2 and sorted(set(table["compress_question"])) == ["false", "true"]
    compressed = table[table["method"] != "full"]
    assert (compressed["0.8"] == "missing").all()  # never zero, never blank
    assert compressed[["0.2", "0.6"]].map(lambda v: 0.0 <= float(v) <= 100.0).all().all()
    full = table[table["method"] == "full"]
    assert (full["0.2"] == full["0.8"]).all()  # the reference has no budget: one value across the row
    for name in ("accuracy", "kept_tokens"):
        png = out / f"{name}.png"
        shape, drawn = _drawn(png)
        assert shape[0] >= 400 and shape[1] >= 800 and 0.02 < drawn < 0.95, name
        assert (out / f"{name}.pdf").read_bytes().startswith(b"%PDF")
    page = (out / "index.html").read_text()
    assert page.count("data:image/png;base64,") >= 2 and "missing" in page
    assert "left out 1 point whose settings differ from the preset" in page
    assert "\\begin{tabular}" in (out / "table.tex").read_text()
