"""The efficiency presets run end to end (`_cpu` twins, shrunk to the tiny model) and their figures come from
the stored records: every PNG is opened and checked for size and drawn pixels, every table for its rows."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import matplotlib.image
import pandas as pd
import pytest

from kvbench.reporting.efficiency import efficiency_table, render

TINY = ["model=tiny_llama", "task.max_new_tokens=6", "profiler.warmup_steps=1"]
PRESETS = {  # preset -> (layout, overrides shrinking its grid, rows expected in the figure's table)
    "rocketkv_fig7_cpu": ("rocketkv_fig7", ["budget=32,64", "task.seq_len=192,320"], 4),
    "keydiff_latency_cpu": ("keydiff_latency", ["budget=32,64", "task.seq_len=256", "method.block_size=32"], 6),
    "omnikv_fig4_cpu": ("omnikv_fig4", ["budget=32", "task.seq_len=192,320"], 4),
    "ctkvr_throughput_cpu": ("ctkvr_throughput", ["budget=32", "task.seq_len=640"], 2),
}


def _drawn_fraction(png: Path) -> tuple[tuple[int, ...], float]:
    pixels = matplotlib.image.imread(png)
    drawn = (pixels[..., :3] < 0.95).any(axis=-1).mean()  # not (near) white
    return pixels.shape, float(drawn)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_cpu_preset_runs_and_its_figure_comes_from_the_records(tmp_path, preset):
    layout, grid, rows = PRESETS[preset]
    result = subprocess.run([sys.executable, "-m", "kvbench", "-m", f"experiment={preset}", *TINY, *grid,
                             f"results_dir={tmp_path}", "show_progress=false"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    table = efficiency_table(tmp_path)
    assert not table["oom"].any() and (table["n"] == 1).all()
    assert table["decode_ms"].notna().all() and table["ttft_s"].notna().all()
    paths = render(tmp_path, layout, tmp_path / "fig")
    assert [p.suffix for p in paths] == [".png", ".pdf", ".csv", ".md"]
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
