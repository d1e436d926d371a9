"""Reports over a results tree: collection, the point table arithmetic, the CLI and the sweep callback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest
from hydra.core.utils import JobReturn, JobStatus
from omegaconf import OmegaConf

from kvbench.cli.report import main
from kvbench.reporting.callback import PrintSweepSummary
from kvbench.reporting.table import (
    INTERVAL_LEGEND,
    TASK_MEAN_LABEL,
    format_table,
    pivot_scores,
    point_table,
    report_text,
)
from kvbench.results.collect import collect
from kvbench.results.store import RecordStore, point_hash

REPO = Path(__file__).resolve().parents[1]
MiB = 2**20


def write_point(root: Path, method: str, budget: float, task: str, samples: list[tuple[str, float]]) -> Path:
    """A run directory whose records are (subtask, score) pairs, numbered per subtask."""
    point = {"model": "tiny", "task": task, "method": method, "budget": budget, "seq_len": 4096,
             "compress_question": False}
    run_dir = root / "tiny" / task / f"{method}_{budget}"
    store = RecordStore(run_dir)
    for i, (subtask, score) in enumerate(samples):
        store.append({"sample_id": f"{subtask}-{i}", "task": subtask, "score": score,
                      "turns": [{"prediction": "p", "score": score}], "nll": 1.0 + i,
                      "decode_ms_per_token": 10.0, "kv_bytes_after_prefill": budget * 8 * MiB,
                      "point": point, "point_hash": point_hash(point)})
    return run_dir


@pytest.fixture
def results(tmp_path: Path) -> Path:
    suite = [("niah", 1.0), ("niah", 0.0), ("vt", 1.0)]  # niah 50, vt 100: task mean 75, sample mean 66.7
    write_point(tmp_path, "snapkv", 0.5, "ruler", suite)
    write_point(tmp_path, "full", 1.0, "ruler", [("niah", 1.0), ("niah", 1.0), ("vt", 1.0)])
    write_point(tmp_path, "snapkv", 0.5, "qa", [("qa", 0.25)])
    (tmp_path / "tiny" / "ruler" / "failed_job" / ".hydra").mkdir(parents=True)  # a job that died early
    return tmp_path


def test_collect_flattens_points_and_reads_only(results: Path) -> None:
    live = results / "tiny" / "qa" / "snapkv_0.5" / "records.jsonl"
    with open(live, "ab") as f:
        f.write(b'{"sample_id": "qa-9", "ta')  # an append in flight from a running job
    before = live.read_bytes()
    df = collect(results)
    assert live.read_bytes() == before  # a report never truncates a live file
    assert len(df) == 7
    assert {"model", "task", "method", "budget", "seq_len", "subtask", "run_dir", "score", "nll"} <= set(df.columns)
    assert "point" not in df.columns and "turns" not in df.columns
    qa = df[df["task"] == "qa"]
    assert list(qa["subtask"]) == ["qa"] and list(qa["run_dir"]) == [str(Path("tiny/qa/snapkv_0.5"))]
    assert set(df[df["task"] == "ruler"]["subtask"]) == {"niah", "vt"}
    assert collect(results / "nothing_here").empty


def test_point_table_math_and_suite_mean(results: Path) -> None:
    table = point_table(collect(results))
    snap = table[(table["task"] == "ruler") & (table["method"] == "snapkv")].set_index("subtask")
    assert list(snap.index) == ["niah", "vt", TASK_MEAN_LABEL]  # mean row after its point's subtasks
    assert snap.loc["niah", "score"] == pytest.approx(50.0) and snap.loc["niah", "n"] == 2
    assert snap.loc["vt", "score"] == pytest.approx(100.0)
    assert snap.loc[TASK_MEAN_LABEL, "score"] == pytest.approx(75.0)  # not the sample mean 66.7
    assert snap.loc[TASK_MEAN_LABEL, "n"] == 3
    assert snap.loc["niah", "nll"] == pytest.approx(1.5)  # samples 0 and 1: nll 1 and 2
    assert snap.loc["niah", "kv_bytes_after_prefill"] == pytest.approx(4 * MiB)
    assert snap.loc["niah", "decode_ms_per_token"] == pytest.approx(10.0)
    qa = table[table["task"] == "qa"]
    assert list(qa["subtask"]) == ["qa"] and qa["score"].iloc[0] == pytest.approx(25.0)  # single task: no mean row
    assert len(table) == 3 + 3 + 1


def test_point_table_intervals_are_of_the_printed_number(results: Path) -> None:
    """niah's two samples (1, 0) resample to a mean of 0, 50 or 100 with probabilities 1/4, 1/2, 1/4: the
    interval is [0, 100]; a subtask or single task with one sample, and a suite mean over it, have none."""
    table = point_table(collect(results))
    snap = table[(table["task"] == "ruler") & (table["method"] == "snapkv")].set_index("subtask")
    assert (snap.loc["niah", "ci_low"], snap.loc["niah", "ci_high"]) == (0.0, 100.0)
    assert snap[["ci_low", "ci_high"]].loc[["vt", TASK_MEAN_LABEL]].isna().all(axis=None)
    assert table.loc[table["task"] == "qa", ["ci_low", "ci_high"]].isna().all(axis=None)
    full = table[(table["method"] == "full") & (table["subtask"] == "niah")].iloc[0]
    assert (full["ci_low"], full["ci_high"]) == (100.0, 100.0)  # two alike: the bootstrap sees no spread
    assert list(table.columns[table.columns.get_loc("score"):][:3]) == ["score", "ci_low", "ci_high"]
    assert point_table(collect(results)).equals(table)  # seeded: a second report gives the same numbers


def test_shared_decode_steps_are_shown_beside_ms_per_token(tmp_path: Path) -> None:
    """Points decoded together record their share of each shared step as ms/token: the table says how many rows
    shared it and that it is not the method's latency; a table of points decoded alone is unchanged."""
    alone = tmp_path / "alone"
    write_point(alone, "snapkv", 64, "qa", [("qa", 1.0), ("qa", 0.0)])
    write_point(alone, "full", 1.0, "qa", [("qa", 1.0), ("qa", 1.0)])
    text = report_text(alone)
    assert "rows/step" not in text and "not the method's own latency" not in text

    shared = tmp_path / "shared"
    for run_dir, rows in ((write_point(shared, "snapkv", 64, "qa", [("qa", 1.0), ("qa", 0.0)]), [5, 4]),
                          (write_point(shared, "full", 1.0, "qa", [("qa", 1.0), ("qa", 1.0)]), [5, 5])):
        path = run_dir / "records.jsonl"
        records = [json.loads(line) for line in path.read_text().splitlines()]
        path.write_text("".join(json.dumps({**r, "decode_batched_rows": n}) + "\n" for r, n in zip(records, rows)))
    table = point_table(collect(shared)).set_index("method")
    assert table.loc["snapkv", "decode_batched_rows"] == pytest.approx(4.5)
    text = report_text(shared)
    header = next(line for line in text.splitlines() if line.lstrip().startswith("method"))
    assert header.split()[-2:] == ["ms/token", "rows/step"]
    rows = {line.split()[0]: line.split()[-1] for line in text.splitlines() if line.lstrip().startswith(("full", "snapkv"))}
    assert rows == {"full": "5", "snapkv": "4.5"}
    assert "not the method's own latency; profile=true times a point alone" in text


def test_points_differing_only_in_hidden_settings_stay_apart(tmp_path: Path) -> None:
    point = {"model": "m", "task": "qa", "method": "snapkv", "budget": 0.5}
    for seed, score in ((0, 1.0), (1, 0.0)):
        RecordStore(tmp_path / f"seed{seed}").append(
            {"sample_id": "a", "task": "qa", "score": score, "point": point,
             "point_hash": point_hash({**point, "seed": seed})})
    table = point_table(collect(tmp_path))
    assert sorted(table["score"]) == [0.0, 100.0]
    with pytest.raises(ValueError, match="differ only in fields not shown"):
        pivot_scores(table, ["method"])


def test_pivot_and_format(results: Path) -> None:
    table = point_table(collect(results))
    wide = pivot_scores(table, ["method", "budget"])
    assert wide.attrs["score_columns"] == ["full/1.0", "snapkv/0.5"]
    assert list(wide["subtask"]) == ["qa", "niah", "vt", TASK_MEAN_LABEL]  # suite mean row stays last
    row = wide[(wide["task"] == "ruler") & (wide["subtask"] == TASK_MEAN_LABEL)].iloc[0]
    assert row["snapkv/0.5"] == pytest.approx(75.0) and row["full/1.0"] == pytest.approx(100.0)
    text = format_table(wide)
    assert "snapkv/0.5" in text and "75.0" in text and "nan" not in text
    plain = format_table(table)
    assert "66.7" not in plain and "75.0" in plain and "4.0 MiB" in plain and "1.500" in plain
    md = format_table(table, markdown=True).splitlines()
    assert md[0].startswith("| model |") and set(md[1]) <= set("|-:") and len(md) == len(table) + 2
    assert format_table(pd.DataFrame()) == "(no records)"


def test_cli_prints_table_and_writes_csv(results: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    csv = tmp_path / "out.csv"
    assert main([str(results), "--csv", str(csv)]) == 0
    out = capsys.readouterr().out
    assert "snapkv" in out and TASK_MEAN_LABEL in out and "75.0" in out
    assert len(pd.read_csv(csv)) == 7
    assert main([str(results), "--pivot", "method,budget", "--markdown"]) == 0
    note, blank, header = capsys.readouterr().out.splitlines()[:3]
    assert note == "model tiny, seq_len 4096, compress_question False" and blank == ""  # constant: said once
    assert header == "| task | subtask | full/1.0 | snapkv/0.5 |"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main([str(empty)]) == 1
    with pytest.raises(SystemExit) as exit_info:
        main([str(results), "--pivot", "nonexistent"])
    assert exit_info.value.code == 2


def test_method_variants_get_their_own_names(tmp_path: Path) -> None:
    from kvbench.methods import METHODS

    defaults = METHODS["snapkv"]().params()
    variants = {"plain": ({}, {}), "block": ({"block_size": 128}, {}), "prof": ({}, {"profile": {"ttft_s": 0.1}})}
    for name, (params, extra) in variants.items():
        point = {"model": "m", "task": "qa", "method": "snapkv", "budget": 64}
        RecordStore(tmp_path / name).append({"sample_id": "a", "task": "qa", "score": 1.0, "point": point,
                                             "point_hash": point_hash({**point, "v": name}),
                                             "method_params": {**defaults, **params}, **extra})
    point = {"model": "m", "task": "qa", "method": "adakv", "budget": 64}  # one variant, not the default one
    RecordStore(tmp_path / "ada").append({"sample_id": "a", "task": "qa", "score": 1.0, "point": point,
                                          "point_hash": point_hash(point),
                                          "method_params": {**METHODS["adakv"]().params(), "window": 16}})
    table = point_table(collect(tmp_path))
    assert sorted(table["method"]) == ["adakv", "snapkv", "snapkv+profile", "snapkv[block_size=128]"]
    wide = pivot_scores(table, ["method"])  # no longer three "snapkv" columns that would collide
    assert {"snapkv", "snapkv+profile", "snapkv[block_size=128]"} <= set(wide.columns)


def test_two_dtypes_are_two_rows_never_one_mean(tmp_path: Path) -> None:
    for dtype, score in (("float32", 1.0), ("bfloat16", 0.0)):
        point = {"model": "m", "task": "qa", "method": "snapkv", "budget": 64, "dtype": dtype}
        RecordStore(tmp_path / dtype).append({"sample_id": "a", "task": "qa", "score": score, "point": point,
                                              "point_hash": point_hash(point)})
    table = point_table(collect(tmp_path))
    bare = table.copy()
    bare.attrs.clear()  # a frame that does not list its point columns: the default POINT_FIELDS hold dtype
    for frame in (table, bare):
        wide = pivot_scores(frame, ["method", "budget"])
        assert dict(zip(wide["dtype"], wide["snapkv/64"])) == {"bfloat16": 0.0, "float32": 100.0}
    lines = report_text(tmp_path).splitlines()
    assert lines[0] == "model m, task qa, n 1" and lines[1].split() == ["method", "budget", "dtype", "score"]


def test_report_text_shows_what_varies_and_names_the_rest_once(results: Path) -> None:
    lines = report_text(results).splitlines()
    assert lines[0] == "model tiny, seq_len 4096, compress_question False"
    assert lines[1].split() == ["task", "method", "budget", "subtask", "n", "score", "nll", "KV", "MiB", "ms/token"]
    assert "point_hash" not in lines[1] and len(lines) == 2 + 7 + 1 and lines[-1] == INTERVAL_LEGEND
    niah = next(line for line in lines if "snapkv" in line and "niah" in line).split()
    assert niah[:6] == ["ruler", "snapkv", "0.5", "niah", "2", "50.0"] and niah[6:8] == ["[0.0,", "100.0]"]
    only = report_text(results, run_dirs=[results / "tiny" / "qa" / "snapkv_0.5"]).splitlines()
    assert only[0] == "model tiny, task qa, seq_len 4096, compress_question False, n 1"
    assert only[1].split() == ["method", "budget", "score", "nll", "KV", "MiB", "ms/token"]
    assert only[2].split() == ["snapkv", "0.5", "25.0", "1.000", "4.0", "10.00"]
    assert report_text(results, run_dirs=[]) == "(no records)"


def test_cli_bad_input_is_one_error_line(results: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    cases = [(["/no/such/dir"], "results directory /no/such/dir does not exist"),
             ([str(results), "--out", str(blocker / "report")], f"cannot write {blocker / 'report'}"),
             ([str(results), "--csv", str(blocker / "t.csv")], f"cannot write {blocker / 't.csv'}"),
             (["experiment=demo", "budgt=64"], "experiment demo: Could not override 'budgt'"),
             (["experiment=demo", "method=nosuch"],
              "experiment demo: In 'config': Could not find 'method/nosuch' (available: ada_pyramid, "),
             ([str(results), "budget=64"], "budget=64: KEY=VALUE overrides apply to experiment=NAME")]
    for argv, message in cases:
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        err = capsys.readouterr().err
        assert exit_info.value.code == 2, argv
        assert f"kvbench report: error: {message}" in err and "Traceback" not in err, (argv, err)
        assert len([line for line in err.splitlines() if "error" in line]) == 1


def test_module_entry_point_help() -> None:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-m", "kvbench.report", "--help"], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0 and "--pivot" in proc.stdout and "RESULTS_DIR" in proc.stdout.upper()


def test_callback_prints_on_multirun_end(results: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = OmegaConf.create({"hydra": {"sweep": {"dir": str(results)}}})
    callback = PrintSweepSummary(pivot="method,budget")
    callback.on_multirun_start(cfg)
    for point in results.rglob("records.jsonl"):  # the sweep's jobs end (the table shows only their points)
        job = OmegaConf.create({"hydra": {"sweep": {"dir": str(results)}, "runtime": {"output_dir": str(point.parent)}}})
        callback.on_job_end(job, JobReturn(status=JobStatus.COMPLETED))
    callback.on_multirun_end(cfg)
    out = capsys.readouterr().out
    assert f"Results of sweep {results}\n" in out and "snapkv/0.5" in out and "did not finish" not in out
    assert "50.0 [0.0, 100.0] n=2" in out and "25.0 n=1" in out  # the score's n and interval, in every cell
    assert INTERVAL_LEGEND in out


def test_hydra_sweep_with_a_failed_job_still_prints(tmp_path: Path) -> None:
    """A real multirun: one job raises, Hydra aborts before on_multirun_end, the table still prints."""
    app = tmp_path / "app.py"
    app.write_text(textwrap.dedent("""
        from pathlib import Path
        import hydra
        from hydra.core.hydra_config import HydraConfig
        from kvbench.results import RecordStore

        @hydra.main(version_base=None, config_path=".", config_name="cfg")
        def run(cfg):
            if cfg.method == "bad":
                raise RuntimeError("boom")
            point = {"model": "m", "task": "qa", "method": cfg.method, "budget": 0.5}
            RecordStore(Path(HydraConfig.get().runtime.output_dir)).append(
                {"sample_id": "a", "task": "qa", "score": 1.0, "point": point})

        run()
    """))
    (tmp_path / "cfg.yaml").write_text(textwrap.dedent(f"""
        method: snapkv
        hydra:
          sweep: {{dir: {tmp_path / "sweep"}, subdir: "${{method}}"}}
          callbacks:
            summary: {{_target_: kvbench.report.PrintSweepSummary}}
    """))
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, str(app), "-m", "method=snapkv,bad,full"], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode != 0 and "boom" in proc.stderr
    assert proc.stdout.count("Results of sweep") == 1 and "sweep did not finish" in proc.stdout
    assert "snapkv" in proc.stdout and "full" in proc.stdout
    assert "FAILED: method=bad" in proc.stdout


def test_a_table_of_sampled_responses_says_its_intervals_resample_problems(tmp_path: Path) -> None:
    """Issue 65: Math-500's points hold 3 sampled responses per problem; their intervals resample problems, and
    the legend under the table says so. A table of other tasks keeps the legend over samples."""
    point = {"model": "tiny", "task": "math500", "method": "full", "budget": None}
    store = RecordStore(tmp_path / "math")
    for p in range(4):
        for k in range(3):
            store.append({"sample_id": f"math500/p{p}/{k}", "task": "math500", "score": float(p % 2),
                          "meta": {"unique_id": f"p{p}", "samples_per_problem": 3}, "point": point,
                          "point_hash": point_hash(point)})
    table = point_table(collect(tmp_path))
    assert table.attrs["resampled"] == "problems (each with its 3 sampled responses; n counts responses)"
    text = report_text(tmp_path)
    legend = ("score x100 [95% bootstrap interval over problems (each with its 3 sampled responses; n counts "
              "responses), stratified by subtask]; no brackets: fewer than 2 samples or problems in a subtask")
    assert text.splitlines()[-1] == legend and INTERVAL_LEGEND not in text
    assert "50.0 [0.0, 100.0]" in text  # 2 of 4 problems right: Binomial(4, 0.5) / 4, not (12, 0.5) / 12
    wide = report_text(tmp_path, pivot=["method", "budget"])
    assert wide.splitlines()[-1] == legend
    write_point(tmp_path, "snapkv", 0.5, "qa", [("qa", 1.0), ("qa", 0.0)])  # beside it, a task without problems
    assert report_text(tmp_path).splitlines()[-1] == legend.replace("n counts responses)", "n counts responses), "
                                                                    "samples elsewhere")
    assert report_text(tmp_path, run_dirs=[tmp_path / "tiny" / "qa" / "snapkv_0.5"]).splitlines()[-1] == (
        INTERVAL_LEGEND)
