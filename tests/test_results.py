"""Run-directory storage: crash-safe records, resume, manifests and the summary arithmetic."""

from __future__ import annotations

import itertools
import json
import logging
import multiprocessing
import multiprocessing.synchronize
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

from kvbench.results.manifest import KERNEL_CPU_FEATURES, build_manifest, git_state, write_manifest
from kvbench.results.store import RecordStore, load_records, point_hash
from kvbench.results.summary import mean_of_subtasks, summarize, write_summary


def rec(sample_id: str, task: str = "qa", score: float = 1.0, **fields: object) -> dict:
    return {"sample_id": sample_id, "task": task, "score": score,
            "turns": [{"prediction": "x", "score": score}], **fields}


def lines_of(path: Path) -> list[str]:
    data = path.read_bytes()
    assert data.endswith(b"\n")
    return data.decode().split("\n")[:-1]


def test_point_hash_is_stable_and_order_independent() -> None:
    a = point_hash({"model": "m", "budget": 0.5, "engine": {"dtype": "bf16", "chunk": 512}})
    b = point_hash({"engine": {"chunk": 512, "dtype": "bf16"}, "budget": 0.5, "model": "m"})
    assert a == b and re.fullmatch(r"[0-9a-f]{12}", a)
    assert a != point_hash({"model": "m", "budget": 0.25, "engine": {"dtype": "bf16", "chunk": 512}})
    assert point_hash({"seed": np.int64(3)}) == point_hash({"seed": 3})
    with pytest.raises(ValueError):
        point_hash({"budget": float("nan")})


def test_append_and_read_back(tmp_path: Path) -> None:
    import torch  # here, not at module level: the spawned writers below import this module

    store = RecordStore(tmp_path / "run")
    store.append(rec("a", nll=np.float32(1.5), kept_tokens=np.int64(7), kv=torch.tensor(2.0)))
    store.append(rec("b", prediction="line\nbreak \u2028 and unicode é"))
    lines = lines_of(store.path)
    assert len(lines) == 2 and all(json.loads(line) for line in lines)
    got = store.records()
    assert [r["sample_id"] for r in got] == ["a", "b"]
    assert got[0]["nll"] == 1.5 and got[0]["kept_tokens"] == 7 and got[0]["kv"] == 2.0
    assert got[1]["prediction"] == "line\nbreak \u2028 and unicode é"


def test_nan_written_as_null_with_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = RecordStore(tmp_path)
    with caplog.at_level(logging.WARNING):
        store.append(rec("a", nll=float("nan"), decode_ms_per_token=np.float64("inf")))
    assert "NaN" not in store.path.read_text() and "Infinity" not in store.path.read_text()
    assert store.records()[0]["nll"] is None and store.records()[0]["decode_ms_per_token"] is None
    assert "a.nll" in caplog.text


def test_append_requires_sample_id(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        RecordStore(tmp_path).append({"task": "qa", "score": 1.0})


def test_torn_last_line_is_truncated_on_open(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = RecordStore(tmp_path)
    store.append(rec("a"))
    store.append(rec("b"))
    with open(store.path, "ab") as f:  # a process killed in the middle of writing record "c"
        f.write(json.dumps(rec("c")).encode()[:25])
    assert [r["sample_id"] for r in load_records(tmp_path)] == ["a", "b"]  # readers skip it, untouched
    assert not store.path.read_bytes().endswith(b"\n")

    with caplog.at_level(logging.WARNING):
        reopened = RecordStore(tmp_path)
    assert "torn last line" in caplog.text
    assert reopened.completed_ids() == {"a", "b"}
    reopened.append(rec("c"))
    lines = lines_of(store.path)
    assert [json.loads(line)["sample_id"] for line in lines] == ["a", "b", "c"]


def test_torn_only_line_truncates_to_empty(tmp_path: Path) -> None:
    (tmp_path / "records.jsonl").write_bytes(b'{"sample_id": "a", "ta')
    store = RecordStore(tmp_path)
    assert store.path.read_bytes() == b"" and store.completed_ids() == set()


def test_resume_after_crash_completes_exactly_once(tmp_path: Path) -> None:
    ids = [f"s{i}" for i in range(5)]
    first = RecordStore(tmp_path)
    for sid in ids[:3]:
        first.append(rec(sid))
    del first  # "crash": nothing but the file survives

    resumed = RecordStore(tmp_path)
    done = resumed.completed_ids()
    assert done == set(ids[:3])
    for sid in ids:
        if sid not in done:
            resumed.append(rec(sid))
    got = [r["sample_id"] for r in RecordStore(tmp_path).records()]
    assert got == ids and len(lines_of(resumed.path)) == 5


def test_duplicates_and_corrupt_lines_keep_first(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = RecordStore(tmp_path)
    store.append(rec("a", score=1.0))
    store.append(rec("a", score=0.0))  # a racing second writer on the same point
    with open(store.path, "ab") as f:
        f.write(b"not json\n[1, 2]\n")
    store.append(rec("b"))
    with caplog.at_level(logging.WARNING):
        got = store.records()
    assert [(r["sample_id"], r["score"]) for r in got] == [("a", 1.0), ("b", 1.0)]
    assert "duplicate sample_id 'a'" in caplog.text and "corrupt line" in caplog.text


def _writer(run_dir: str, name: str, n: int, start: multiprocessing.synchronize.Barrier) -> None:
    store = RecordStore(Path(run_dir))
    start.wait()  # both processes append at the same time, not one after the other
    for i in range(n):
        # Lines larger than a page, so a non-atomic append would show as interleaving.
        store.append(rec(f"{name}-{i}", prediction=name * 6000))


def test_concurrent_appends_from_two_processes_stay_whole_lines(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Barrier(2)
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), name, 200, start)) for name in ("p", "q")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    lines = lines_of(tmp_path / "records.jsonl")
    assert len(lines) == 400
    parsed = [json.loads(line) for line in lines]  # every line is one whole record
    for r in parsed:
        assert r["prediction"] == r["sample_id"][0] * 6000
    assert {r["sample_id"] for r in parsed} == {f"{n}-{i}" for n in "pq" for i in range(200)}
    writers = [r["sample_id"][0] for r in parsed]
    assert sum(a != b for a, b in itertools.pairwise(writers)) > 1  # the appends really did overlap


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                   check=True, capture_output=True)


def test_git_state_reports_sha_and_dirty(tmp_path: Path) -> None:
    assert git_state(tmp_path) == (None, None)
    _git(tmp_path, "init", "-q")
    (tmp_path / "f.py").write_text("x = 1\n")
    _git(tmp_path, "add", "f.py")
    _git(tmp_path, "commit", "-q", "-m", "init")
    sha, dirty = git_state(tmp_path)
    assert re.fullmatch(r"[0-9a-f]{40}", sha) and dirty is False
    (tmp_path / "f.py").write_text("x = 2\n")
    assert git_state(tmp_path) == (sha, True)
    (tmp_path / ".gitignore").write_text("venv/\n")
    (tmp_path / "venv").mkdir()
    assert git_state(tmp_path / "venv") == (None, None)  # an installed copy is not the repo's code


def test_manifest_contents() -> None:
    import torch

    m = build_manifest(seed=7, extra={"point_hash": "abc"})
    assert m["seed"] == 7 and m["point_hash"] == "abc"
    assert set(m["versions"]) >= {"torch", "transformers", "hydra-core", "datasets", "triton", "numpy", "pandas",
                                  "kvbench"}
    assert m["versions"]["torch"] == torch.__version__
    assert m["git_sha"] is None or re.fullmatch(r"[0-9a-f]{40}", m["git_sha"])
    assert m["cpu"]["count"] >= 1 and m["ram_bytes"] > 0 and isinstance(m["gpus"], list)
    assert m["timestamp_utc"].endswith("+00:00")
    json.dumps(m)  # plain JSON
    with pytest.raises(ValueError):
        build_manifest(seed=1, extra={"seed": 2})


def test_write_manifest_keeps_original_and_appends_resumes(tmp_path: Path,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    first = build_manifest(seed=1)
    write_manifest(tmp_path, first)
    second = dict(build_manifest(seed=1), git_sha="f" * 40)
    with caplog.at_level(logging.WARNING):
        write_manifest(tmp_path, second)
    assert "git_sha" in caplog.text  # mixed code is flagged
    write_manifest(tmp_path, build_manifest(seed=1))
    stored = json.loads((tmp_path / "manifest.json").read_text())
    assert stored["timestamp_utc"] == first["timestamp_utc"] and stored["git_sha"] == first["git_sha"]
    assert [r["git_sha"] for r in stored["resumes"]] == ["f" * 40, first["git_sha"]]


def test_a_resume_with_another_decode_attention_is_flagged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """bf16 on a CPU with AMX runs stock SDPA, elsewhere two matmuls: a point resumed on the other kind mixes them."""
    write_manifest(tmp_path, build_manifest(seed=1, extra={"decode_attention": "sdpa"}))
    with caplog.at_level(logging.WARNING):
        write_manifest(tmp_path, build_manifest(seed=1, extra={"decode_attention": "matmul"}))
    assert "decode_attention" in caplog.text
    features = build_manifest(seed=1)["cpu"]["features"]  # the flags that pick kernels, None off Linux
    assert features is None or (set(features) <= set(KERNEL_CPU_FEATURES) and list(features) == sorted(
        features, key=KERNEL_CPU_FEATURES.index))


def test_summarize_by_hand() -> None:
    records = [
        # subtask "niah": 4 samples, scores 1, 1, 0, 0.5 -> mean 0.625
        rec("n1", "niah", 1.0, nll=1.0, prefill_s=2.0),
        rec("n2", "niah", 1.0, nll=2.0, prefill_s=2.0),
        rec("n3", "niah", 0.0, nll=3.0),
        rec("n4", "niah", 0.5, nll=None),
        # subtask "vt": 1 sample, score 0 -> mean 0
        rec("v1", "vt", 0.0, nll=6.0, kept_tokens=10, compressed=True),
    ]
    s = summarize(records)
    assert s["n_samples"] == 5
    assert s["tasks"]["niah"]["n"] == 4 and s["tasks"]["niah"]["score"] == pytest.approx(62.5)
    assert s["tasks"]["vt"]["score"] == pytest.approx(0.0)
    assert s["score"] == pytest.approx((62.5 + 0.0) / 2)  # mean of task means, not 2.5/5
    assert s["score_micro"] == pytest.approx(100 * 2.5 / 5)
    assert s["metrics"]["nll"] == pytest.approx((1 + 2 + 3 + 6) / 4)  # null nll is skipped
    assert s["metrics"]["prefill_s"] == pytest.approx(2.0)
    assert s["metrics"]["kept_tokens"] == pytest.approx(10.0)
    assert "compressed" not in s["metrics"] and "score" not in s["metrics"]  # bools and score are not metrics
    assert s["tasks"]["niah"]["metrics"]["nll"] == pytest.approx(2.0)
    assert "turn_scores" not in s["tasks"]["niah"]
    assert s["score_ci"] is None and s["tasks"]["vt"]["score_ci"] is None  # vt's one sample: no interval
    low, high = s["tasks"]["niah"]["score_ci"]
    assert 0.0 <= low < 62.5 < high <= 100.0


def test_summary_interval_is_the_stratified_bootstrap_of_its_score() -> None:
    """Subtask a always 1, b 0 and 1: b's resampled mean is 0, 0.5, 1 (1/4, 1/2, 1/4), so the score (1 + b) / 2
    x100 has the interval [50, 100] (kvbench.results.stats), whatever the records' order."""
    records = [rec("a1", "a", 1.0), rec("b1", "b", 0.0), rec("a2", "a", 1.0), rec("b2", "b", 1.0)]
    s = summarize(records)
    assert s["score"] == 75.0 and s["score_ci"] == [50.0, 100.0]
    assert summarize(records[::-1])["score_ci"] == s["score_ci"]


def test_scores_of_loaded_records_carry_n_and_the_interval(tmp_path: Path) -> None:
    from kvbench.results import load, scores

    for name, values in (("x", [("a", 1.0), ("a", 1.0), ("b", 0.0), ("b", 1.0)]), ("y", [("a", 0.5)])):
        point = {"model": "m", "task": "suite", "method": name, "budget": 64}
        store = RecordStore(tmp_path / name)
        for i, (task, score) in enumerate(values):
            store.append(rec(f"{task}{i}", task, score, point=point, point_hash=point_hash(point)))
    table = scores(load(tmp_path)).set_index("method")
    assert table.loc["x", ["n", "score", "ci_low", "ci_high"]].tolist() == [4, 75.0, 50.0, 100.0]
    assert table.loc["y", "n"] == 1 and np.isnan(table.loc["y", "ci_low"])  # one sample: no interval
    per = scores(load(tmp_path), by_subtask=True).set_index(["method", "subtask"])
    assert per.loc[("x", "b"), ["score", "ci_low", "ci_high"]].tolist() == [50.0, 0.0, 100.0]


def test_summarize_single_task_and_turns() -> None:
    multi = [
        {"sample_id": "a", "task": "kv", "score": 0.5, "turns": [{"score": 1.0}, {"score": 0.0}]},
        {"sample_id": "b", "task": "kv", "score": 1.0, "turns": [{"score": 1.0}, {"score": 1.0}, {"score": 1.0}]},
    ]
    s = summarize(multi)
    assert s["score"] == s["score_micro"] == pytest.approx(75.0)
    assert s["tasks"]["kv"]["turn_scores"] == pytest.approx([100.0, 50.0, 100.0])
    assert summarize([])["score"] is None and summarize([])["n_samples"] == 0


def test_mean_of_subtasks_leaves_out_subtasks_without_a_value() -> None:
    """The one rule behind a summary's score, the point table's task mean row and the paper tables' scores."""
    assert mean_of_subtasks([50.0, None, 100.0]) == 75.0
    assert mean_of_subtasks([None, None]) is None and mean_of_subtasks([]) is None
    assert np.isnan(mean_of_subtasks([], empty=float("nan")))


def test_summarize_rejects_mixed_points() -> None:
    with pytest.raises(ValueError):
        summarize([rec("a", point_hash="x"), rec("b", point_hash="y")])


def test_write_summary_roundtrip(tmp_path: Path) -> None:
    records = [rec("a", point={"model": "m"}, point_hash="h"), rec("b", score=0.0, point={"model": "m"},
                                                                  point_hash="h")]
    write_summary(tmp_path, summarize(records))
    stored = json.loads((tmp_path / "summary.json").read_text())
    assert stored["score"] == pytest.approx(50.0) and stored["point_hash"] == "h" and stored["point"] == {"model": "m"}
    assert not list(tmp_path.glob(".*.tmp"))
