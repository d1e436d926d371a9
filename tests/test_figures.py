"""The efficiency presets run end to end (`_cpu` twins, shrunk to the tiny model) and their figures come from
the stored records: every PNG is opened and checked for size and drawn pixels, every table for its rows."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import matplotlib.figure
import matplotlib.image
import matplotlib.pyplot as plt
import pandas as pd
import pytest

from kvbench.reporting.efficiency import efficiency_table, render

TINY = ["model=tiny_llama", "task.max_new_tokens=6", "profiler.warmup_steps=1"]
PRESETS = {  # preset -> (layout, overrides shrinking its grid, rows expected in the figure's table)
    "rocketkv_fig7_cpu": ("rocketkv_fig7", ["budget=32,64", "task.seq_len=192,320"], 4),
    "keydiff_latency_cpu": ("keydiff_latency", ["budget=32,64", "task.seq_len=256", "method.block_size=32"], 6),
    "omnikv_fig4_cpu": ("omnikv_fig4", ["budget=32", "task.seq_len=192,320"], 4),
    "ctkvr_throughput_cpu": ("ctkvr_throughput", ["budget=32", "task.seq_len=640"], 2),
    "ctkvr_table13_cpu": ("ctkvr_table13", ["budget=32", "task.seq_len=640"], 2),
}


def _drawn_fraction(png: Path) -> tuple[tuple[int, ...], float]:
    pixels = matplotlib.image.imread(png)
    drawn = (pixels[..., :3] < 0.95).any(axis=-1).mean()  # not (near) white
    return pixels.shape, float(drawn)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_cpu_preset_runs_and_its_figure_comes_from_the_records(tmp_path, preset, monkeypatch):
    layout, grid, rows = PRESETS[preset]
    titles = []
    suptitle = matplotlib.figure.Figure.suptitle
    monkeypatch.setattr(matplotlib.figure.Figure, "suptitle", lambda fig, t, **kw: titles.append(t) or suptitle(fig, t, **kw))
    result = subprocess.run([sys.executable, "-m", "kvbench", "-m", f"experiment={preset}", *TINY, *grid,
                             f"results_dir={tmp_path}", "show_progress=false"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    table = efficiency_table(tmp_path)
    assert not table["oom"].any() and (table["n"] == 1).all()
    assert table["decode_ms"].notna().all() and table["ttft_s"].notna().all()
    paths = render(tmp_path, layout, tmp_path / "fig")
    assert [p.suffix for p in paths] == [".png", ".pdf", ".csv", ".md"]
    # the title names the preset and its settings, never the results directory (a machine's path)
    assert titles == [f"{preset}: tiny_llama; float32; memory: weights + K/V peak + method state"]
    shape, drawn = _drawn_fraction(paths[0])
    assert shape[0] >= 400 and shape[1] >= 1000 and 0.02 < drawn < 0.9
    assert paths[1].stat().st_size > 5000 and paths[1].read_bytes().startswith(b"%PDF")
    shown = pd.read_csv(paths[2])
    compressed = shown[shown["method"] != "full"] if layout == "rocketkv_fig7" else shown
    assert len(compressed) == (rows if layout != "rocketkv_fig7" else rows)
    if layout == "rocketkv_fig7":  # normalised to the full cache, and to the repeated-K/V baseline, at each length
        assert shown["speedup"].notna().all() and shown["memory_saving_pct"].notna().all()
        assert shown["speedup_vs_repeated_kv"].notna().all() and shown["baseline_factor"].notna().all()
        assert table["repeated_kv"].sum() == 2 and (table[table["repeated_kv"]]["method"] == "full").all()  # per length


def test_an_oom_point_is_marked_never_drawn_as_a_value(tmp_path):
    import json

    from kvbench.results.store import RecordStore

    for i, (method, seq_len, oom) in enumerate([("full", 1024, False), ("full", 2048, True), ("omnikv", 2048, False)]):
        store = RecordStore(tmp_path / f"p{i}")
        point = {"model": "m", "task": "synthetic", "method": method, "budget": 64, "seq_len": seq_len, "dtype": "float32"}
        record = {"sample_id": "s", "task": "synthetic", "score": None, "point": point, "point_hash": f"h{i}",
                  "method_params": {}}
        record.update({"oom": True, "turns": []} if oom else
                      {"profile": {"decode_ms_median": 10.0 * (i + 1), "ttft_s": 1.0, "memory_kind": "cpu_rss_high_water_mark",
                                   "state_peak_bytes": 2**20}, "turns": [{"prediction": ""}]})
        store.append(json.loads(json.dumps(record)))
    table = efficiency_table(tmp_path)
    oom_row = table[(table["method"] == "full") & (table["seq_len"] == 2048)].iloc[0]
    assert oom_row["oom"] and pd.isna(oom_row["decode_ms"])
    paths = render(tmp_path, "omnikv_fig4", tmp_path / "fig")
    assert "True" in paths[3].read_text()  # the table says oom
    assert _drawn_fraction(paths[0])[1] > 0.02


def test_timings_carry_their_spread_over_samples(tmp_path):
    """Each timing's median comes with its min and max over the point's samples, in the tables and as error
    bars; a speedup's spans every ratio of the two points' samples (Full 10-12 ms, the method 4-6: 10/6 to 3)."""
    import json

    from matplotlib.collections import LineCollection

    from kvbench.reporting.efficiency import omnikv_fig4, rocketkv_fig7
    from kvbench.results.store import RecordStore

    for method, times in (("full", [10.0, 12.0, 11.0]), ("omnikv", [5.0, 4.0, 6.0])):
        point = {"model": "m", "task": "synthetic", "method": method, "budget": 64, "seq_len": 1024,
                 "dtype": "float32"}
        store = RecordStore(tmp_path / method)
        for j, ms in enumerate(times):
            store.append(json.loads(json.dumps({
                "sample_id": f"s{j}", "task": "synthetic", "score": None, "point": point, "point_hash": method,
                "method_params": {}, "turns": [{"prediction": ""}],
                "profile": {"decode_ms_median": ms, "ttft_s": 1.0 + j, "memory_kind": "cpu_rss_high_water_mark",
                            "state_peak_bytes": 2**20}})))
    table = efficiency_table(tmp_path).set_index("method")
    assert table.loc["omnikv", ["decode_ms", "decode_ms_min", "decode_ms_max"]].tolist() == [5.0, 4.0, 6.0]
    assert table.loc["omnikv", ["decode_tokens_per_s_min", "decode_tokens_per_s_max"]].tolist() == [
        pytest.approx(1e3 / 6), pytest.approx(1e3 / 4)]
    assert table.loc["full", ["ttft_s_min", "ttft_s_max"]].tolist() == [1.0, 3.0]
    fig, axes = plt.subplots(1, 2)
    omnikv_fig4(table.reset_index(), axes)
    bars = sorted(tuple(c.get_segments()[0][:, 1]) for c in axes[0].collections if isinstance(c, LineCollection))
    assert bars == [(4.0, 6.0), (10.0, 12.0)]
    fig, axes = plt.subplots(1, 2)
    speedup = rocketkv_fig7(table.reset_index(), axes).iloc[0]
    assert (speedup["speedup"], speedup["speedup_min"], speedup["speedup_max"]) == (
        pytest.approx(11 / 5), pytest.approx(10 / 6), pytest.approx(3.0))
    plt.close("all")
