"""The command line: one clear error line for bad input, and resume after an interrupted sweep."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

TINY = ["model=tiny_llama", "task=twostage_retr", "task.num_samples=4", "task.max_new_tokens=8", "engine.nll=false"]


def kvbench(*args: str, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvbench", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


def records(root: Path) -> dict[str, list[dict]]:
    return {
        str(p.parent.relative_to(root)): [json.loads(line) for line in p.read_text().splitlines()]
        for p in root.rglob("records.jsonl")
    }


@pytest.mark.parametrize(
    "args,message",
    [
        (["method=nope"], "unknown method 'nope'; available: ada_pyramid, adakv"),
        (["task=nope"], "unknown task 'nope'"),
        (["model=nope"], "unknown model 'nope'"),
        (["-m", "method=full,nope"], "unknown method 'nope'"),
        (["model=tiny_llama", "budget=0"], "budget must be a positive number"),
        (["model=tiny_llama", "budget=-5"], "budget must be a positive number"),
        (["model=tiny_llama", "task=ruler_niah_single_1", "task.seq_len=100000"], "tiny_llama allows at most 8192 positions"),
        (["model=tiny_llama", "task=ruler_niah_single_1", "task.seq_len=300"], "sequence length is too small"),
        (["model=tiny_llama", "task=niah", "task.haystack=foo"], "unknown haystack 'foo'"),
        (["model=tiny_llama", "task=longbench", "task.data_dir=/nonexistent"], "LongBench data (THUDM/LongBench) not found"),
        (["model=tiny_llama", "method=keydiff", "method.block_size=0"], "method keydiff: block_size must be a positive"),
        (["model=tiny_llama", "method=adakv", "method.alpha=2"], "method adakv: alpha (the per-head floor"),
        # issue 13: every setting is checked before anything runs, and the message names it
        (["model=tiny_llama", "task.num_samples=0"], "task.num_samples must be a positive integer"),
        (["model=tiny_llama", "task.num_samples=-1"], "task.num_samples must be a positive integer"),
        (["model=tiny_llama", "task=twostage_retr", "task.max_new_tokens=0"], "task.max_new_tokens must be a positive"),
        (["model=tiny_llama", "task=twostage_retr", "task.chat_template=maybe"],
         "task twostage_retr: chat_template must be true or false, got 'maybe'"),
        (["model=tiny_llama", "task=twostage_retr", "task.answer_prefix=5"],
         "task twostage_retr: answer_prefix must be text or null, got 5"),
        (["model=tiny_llama", "seed=abc"], "seed must be an integer from 0 to 2**32 - 1, got 'abc'"),
        (["model=tiny_llama", "seed=-1"], "seed must be an integer from 0 to 2**32 - 1, got -1"),  # was numpy's traceback
        (["model=tiny_llama", "hydra.sweep.subdir=x"], "hydra.sweep.subdir is kvbench's point directory"),
        (["model=tiny_llama", "hydra.run.dir=out"], "hydra.run.dir is kvbench's point directory"),
        (["model=tiny_llama", "profile=maybe"], "profile must be true or false, got 'maybe'"),  # was a profiled point
        (["model=tiny_llama", "method.foo=1"], "method.foo is not a setting of any method"),  # full ignored it
        (["model=tiny_llama", "model.init_seed=x"], "model.init_seed must be an integer, got 'x'"),
        (["model=tiny_llama", "model.config.num_key_value_heads=3"],
         "model tiny_llama: model.config does not build a llama model: ValueError: num_attention_heads=4 is not a "
         "multiple of num_key_value_heads=3"),  # was a traceback at the first forward
        (["model=tiny_llama", "compress_question=maybe"], "compress_question must be true or false, got 'maybe'"),
        (["model=tiny_llama", "engine.nll=maybe"], "engine.nll must be true or false"),
        (["model=tiny_llama", "compression_ratio=1.5"], "compression_ratio must be a fraction of the tokens removed in [0, 1)"),
        (["model.path=/nonexistent"], "model.path='/nonexistent' does not exist"),
        (["model=tiny_llama", "model.source=foo"], "model.source='foo': expected hf, gguf, package_gguf or tiny"),
        (["model=tiny_llama", "model.path=/tmp"], "model.path is not a setting of model tiny_llama (its settings: source"),
        (["model=tiny_llama", "task.sizes=[40]"], "task.sizes is not a setting of task ruler_niah_single_1"),
        (["model=tiny_llama", "method=snapkv", "method.window=-3"], "method snapkv: window must be a positive number"),
        (["model=tiny_llama", "method=snapkv", "method.window=0"], "method snapkv: window must be a positive number"),
        (["model=tiny_llama", "method=streamingllm", "method.n_sink=-1"], "method streamingllm: n_sink must be a number"),
        (["model=tiny_llama", "method=snapkv", "method.windw=3"],
         "method.windw is not a setting of method snapkv (did you mean method.window?"),
        (["-m", "model=tiny_llama", "method=snapkv,streamingllm", "method.pooling=avg"],
         "method.pooling is not a setting of method streamingllm"),
        (["model=tiny_llama", "method=adakv", "budget=1024", "task=ruler_16k"],
         "task ruler_16k asks for 16384 tokens (task.seq_len) but tiny_llama allows at most 8192 positions: run it with "
         "task.seq_len=8192 or less"),
        # issue 25: refused before anything is created, `+` or not
        (["model=tiny_llama", "budgt=64"], "unknown setting 'budgt' (did you mean budget?)"),
        (["model=tiny_llama", "+budgt=64"], "unknown setting 'budgt' (did you mean budget?)"),
        (["-m", "model=tiny_llama", "++budgt=64,128"], "unknown setting 'budgt' (did you mean budget?)"),
        # issue 39: under engine. and profiler. too, the same line
        (["model=tiny_llama", "engine.batchrows=2"], "unknown setting 'engine.batchrows' (did you mean engine.batch_rows?)"),
        (["model=tiny_llama", "+engine.batchrows=2"], "unknown setting 'engine.batchrows' (did you mean engine.batch_rows?)"),
        (["-m", "model=tiny_llama", "engine.batchrows=1,2"], "unknown setting 'engine.batchrows' (did you mean engine.batch_rows?)"),
        (["model=tiny_llama", "profiler.repeat=2"], "unknown setting 'profiler.repeat' (did you mean profiler.repeats?)"),
        (["model=tiny_llama", "budget=abc"], "budget must be a positive number"),
        (["model=tiny_llama", "budget=1.5"], "budget 1.5 is neither a token count nor a ratio"),
        (["model=tiny_llama", "budget=1.0"], "budget=1.0 is ambiguous"),
        (["-m", "model=tiny_llama", "method=snapkv", "budget=64,-1"], "budget must be a positive number"),
        (["model=tiny_llama", "budget=64", "compression_ratio=0.5"], "budget and compression_ratio both given"),
        (["model=tiny_llama", "engine.batch_rows=0"], "engine.batch_rows must be a positive integer, got 0"),
        (["model=tiny_llama", "engine.sample_batch=0"], "engine.sample_batch must be a positive integer, got 0"),
        (["model=tiny_llama", "profiler.repeats=0"], "profiler.repeats must be a positive integer, got 0"),
        (["model=tiny_llama", "profiler.stages=true"], "profiler.stages=true times the stages of a profiled run: add "
                                                       "profile=true"),
        (["model=tiny_llama", "profile=true", "profiler.stages=maybe"], "profiler.stages must be true or false"),
        (["-m", "model=tiny_llama", "hydra.launcher.max_group=0"], "hydra.launcher.max_group must be a positive"),
        (["model=tiny_llama", "hydra/launcher=slurm"], "hydra/launcher=slurm submits sweeps: add -m"),
        (["-m", "model=tiny_llama", "method=snapkv,quest", "++method.window=8"],
         "method.window is not a setting of method quest"),
        (["-m", "experiment=demo", "model=tiny_llama", "method=snapkv,quest", "method.window=8"],
         "method.window is not a setting of method quest"),
        # a word that is neither a command nor KEY=VALUE: Hydra's parser printed a traceback
        (["export_samples", "model=tiny_llama"], "unknown command 'export_samples' (commands: report, analyze, "
                                                 "calibrate, export, figures, profile;"),
        (["model=tiny_llama", "method", "snapkv"], "'method' is not an override: write KEY=VALUE"),
        (["-m", "model=tiny_llama", "budget=64,128", "snapkv"], "'snapkv' is not an override: write KEY=VALUE"),
    ],
)
def test_bad_input_gives_one_clear_error_line(tmp_path, args, message):
    """Exit 2, one `kvbench: error:` line naming the setting, no traceback, no records."""
    result = kvbench(*args, f"results_dir={tmp_path}", cwd=tmp_path)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    # one error (a missing dataset adds the commands that fetch it on the following lines)
    assert lines[0].startswith("kvbench: error: ") and message in lines[0]
    assert sum(line.startswith("kvbench: error") for line in lines) == 1
    assert "Traceback" not in result.stderr + result.stdout
    assert not list(tmp_path.rglob("records.jsonl"))
    assert not list(tmp_path.rglob(".hydra")), "an invalid point leaves no directory behind"
    left = [str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_dir()]
    assert not left, f"an invalid point leaves no directory behind (not its task or method folders): {left}"


@pytest.mark.parametrize("args,message", [
    (["task.seq_len=200000"], "llama3.1_8b_instruct allows at most 131072 positions"),
    (["task=custom", "task.path=missing.jsonl", "task.metric=qa_f1"], "custom data missing.jsonl: no such file"),
    (["task=custom"], "task=custom needs task.path=FILE"),
    (["task=longbench_hotpotqa", "task.data_dir=/nonexistent"], "LongBench data (THUDM/LongBench) not found for hotpotqa"),
    (["task=infinitebench", "task.data_dir=/nonexistent"], "InfiniteBench data (xinrongzhang2022/InfiniteBench) not found"),
    (["task=scbench_kv", "task.data_dir=/nonexistent"], "SCBench data for scbench_kv not found: /nonexistent/"),
    (["task=math500", "task.data_dir=/nonexistent"], "Math-500 data not found: /nonexistent/test.jsonl does not exist"),
])
def test_what_the_config_tells_is_refused_before_the_model_loads(tmp_path, args, message):
    """A hub model's load is minutes: a length over its config's declared limit and a data file that is not there
    are refused before it (here the hub is unreachable: a later check would fail on the load instead)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-m", "kvbench", "model=llama3.1_8b_instruct", *args,
                             f"results_dir={tmp_path}"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                            env=env)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    # one error line (a missing dataset adds the commands that fetch it on the lines after it)
    assert lines[0].startswith("kvbench: error: ") and message in lines[0], result.stderr
    assert sum(line.startswith("kvbench: error") for line in lines) == 1 and "Traceback" not in result.stderr
    assert "loading model" not in result.stdout + result.stderr
    assert not [p for p in tmp_path.rglob("*") if p.is_dir()]


def test_budget_at_or_above_context_is_recorded_as_uncompressed(tmp_path):
    result = kvbench(*TINY, "task.num_samples=1", "method=snapkv", "budget=100000", f"results_dir={tmp_path}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    (point,) = records(tmp_path).values()
    assert point[0]["compressed"] is False and point[0]["kv_bytes_after_compress"] > 0
    assert point[0]["kept_tokens_mean"] == point[0]["compressed_segment_tokens"]


def _untimed(value):
    """A record without its wall-clock fields (and whether its prefill was shared, which follows scheduling)."""
    if isinstance(value, dict):
        return {k: _untimed(v) for k, v in value.items()
                if not (k.endswith("_s") or "_ms" in k or k == "prefill_reused")}
    if isinstance(value, list):
        return [_untimed(v) for v in value]
    return value


def test_interrupted_multirun_resumes_without_loss_or_duplicates(tmp_path):
    args = ["-m", *TINY, "method=full,snapkv,adakv", "budget=64", f"results_dir={tmp_path}"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvbench", *args], cwd=tmp_path, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True,
    )
    deadline = time.time() + 240
    try:
        while time.time() < deadline:  # kill mid-sweep: after the second point has started writing
            written = records(tmp_path)
            if len(written) >= 2 and sum(len(v) for v in written.values()) >= 5:
                break
            time.sleep(0.2)
        else:
            pytest.fail("the sweep wrote no records in time")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    before = records(tmp_path)
    assert sum(len(v) for v in before.values()) < 12, "killed too late to test resume"

    result = kvbench(*args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    after = records(tmp_path)
    assert len(after) == 3
    for point, recs in after.items():
        ids = [r["sample_id"] for r in recs]
        assert sorted(ids) == sorted(set(ids)) and len(ids) == 4, point
        assert recs[: len(before.get(point, []))] == before.get(point, []), "finished records must not be redone"
    summaries = [json.loads(p.read_text()) for p in tmp_path.rglob("summary.json")]
    assert sorted(s["n_samples"] for s in summaries) == [4, 4, 4]
    # the resumed sweep's records equal an uninterrupted run's, timings (and prefill sharing) aside
    clean = tmp_path / "uninterrupted"
    clean.mkdir()
    result = kvbench(*args[:-1], f"results_dir={clean}", cwd=clean)
    assert result.returncode == 0, result.stderr
    assert {p: [_untimed(r) for r in recs] for p, recs in records(clean).items()} == {
        p: [_untimed(r) for r in recs] for p, recs in after.items()}
    manifest = json.loads(next(tmp_path.rglob("manifest.json")).read_text())
    assert "git" in json.dumps(manifest) and manifest["seed"] == 42


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_absent_device_names_the_devices_present(tmp_path):
    result = kvbench("model=tiny_llama", "model.device=cuda", f"results_dir={tmp_path}", cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "kvbench: error: model.device='cuda' is not present on this machine; devices here: cpu" in result.stderr
    assert not list(tmp_path.rglob("records.jsonl"))


def test_a_parameter_shared_by_swept_methods_applies_to_each(tmp_path):
    result = kvbench("-m", *TINY, "task.num_samples=1", "method=snapkv,adakv", "method.pooling=avg", "budget=48",
                     f"results_dir={tmp_path}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    points = records(tmp_path)
    assert sorted(p.split("/")[2] for p in points) == ["adakv", "snapkv"]
    assert all(recs[0]["method_params"]["pooling"] == "avg" for recs in points.values())


def test_a_method_setting_the_preset_sweeps_narrows_its_sweep_instead_of_running_each_job_twice():
    """`experiment=keydiff_table12_cpu method.block_size=64`: the preset sweeps block sizes 64 and 256; the
    command's value replaces that sweep (as `budget=256` replaces its budgets), so each (method, budget) is one
    job, at block size 64, not two jobs both forced to 64 (the second resuming the first)."""
    from kvbench.config.command import _compose, _jobs, check_command

    argv = check_command(["-m", "experiment=keydiff_table12_cpu", "method=keydiff,snapkv_block", "budget=256",
                          "method.block_size=64"])
    assert "method.block_size=choice(64)" in argv and not any(a.startswith("++") for a in argv)
    overrides = [a for a in argv if not a.startswith("-")]
    jobs = _jobs(overrides, _compose(overrides, True))
    assert sorted(j for job in jobs for j in job if j.startswith("method")) == [
        "method.block_size=64", "method.block_size=64", "method=keydiff", "method=snapkv_block"]
    swept = check_command(["-m", "experiment=keydiff_table12_cpu", "method.block_size=32,64"])
    assert "method.block_size=32,64" in swept
    # without a preset, a shared setting stays `++` (the base config's default method lacks it)
    assert "++method.window=8" in check_command(["-m", "model=tiny_llama", "method=snapkv,adakv",
                                                 "method.window=8"])


def test_compression_ratio_follows_kvpress_rounding(tmp_path):
    result = kvbench(*TINY, "task.num_samples=2", "method=snapkv", "compression_ratio=0.3", f"results_dir={tmp_path}",
                     cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    ((point, recs),) = records(tmp_path).items()
    assert "/bcr0p3-" in point
    for rec in recs:
        length = rec["compressed_segment_tokens"]
        assert rec["budget_tokens"] == int(length * (1 - 0.3)) == rec["kept_tokens_mean"]
        assert rec["compression_ratio"] == 0.3 and rec["point"]["budget"] is None


def test_help_lists_methods_tasks_models_experiments(tmp_path):
    result = kvbench("--help", cwd=tmp_path)
    assert result.returncode == 0
    from kvbench.methods import METHODS

    listed = next(line for line in result.stdout.splitlines() if line.startswith("method: ")).split(": ")[1]
    configs = listed.split(", ")
    assert set(METHODS) <= set(configs)  # every registered method has its config (plus variants: omnikv_offload)
    parts = {name: name.split("_") for name in configs}  # a variant is a method's name plus a suffix
    assert all(any("_".join(p[:i]) in METHODS for i in range(1, len(p) + 1)) for p in parts.values())
    for needle in ("ruler_niah_single_1", "smollm2_135m", "synthetic", "experiment: ", "demo", "rocketkv_fig7_cpu"):
        assert needle in result.stdout


@pytest.mark.parametrize("command,needle", [("report", "usage: kvbench report"), ("analyze", "usage: kvbench analyze"),
                                             ("calibrate", "usage: kvbench calibrate"),
                                             ("export", "usage: kvbench export"), ("figures", "usage: kvbench figures"),
                                             ("profile", "== Choices")])
def test_each_command_is_a_word_after_kvbench(tmp_path, command, needle):
    """`kvbench NAME --help` for every command the run's help lists (export, figures and profile were reachable
    only as `python -m kvbench.NAME`)."""
    from kvbench.cli.main import COMMANDS

    assert command in COMMANDS
    result = kvbench(command, "--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert needle in result.stdout


@pytest.mark.parametrize("command,required", [("report", "SOURCE|RESULTS_DIR"), ("calibrate", "method")])
def test_a_command_without_arguments_names_only_what_is_required(command, required, capsys):
    """The overrides after a command are optional: argparse listed them as required too (`nargs="*"` without a
    default), which told a newcomer that KEY=VALUE must be given."""
    import importlib

    with pytest.raises(SystemExit) as exit_:
        importlib.import_module(f"kvbench.cli.{command}").main([])
    assert exit_.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.endswith(f"the following arguments are required: {required}"), last


def test_profile_adds_profile_true_unless_given():
    from kvbench.cli.main import with_profile

    assert with_profile(["method=snapkv"]) == ["method=snapkv", "profile=true"]
    assert with_profile(["-m", "profile=false"]) == ["-m", "profile=false"]
    assert with_profile(["++profile=false"]) == ["++profile=false"]


def test_full_cache_points_ignore_the_budget():
    from omegaconf import OmegaConf

    from kvbench.run.identity import point_identity

    def point(method: str, budget: int) -> dict:
        return point_identity(OmegaConf.create({"model": {"dtype": "float32", "device": "cpu"}, "task": {}, "method": {"name": method}, "budget": budget,
                                                "compress_question": True, "engine": {}, "seed": 0}))

    assert point("full", 64) == point("full", 256)  # a sweep runs the reference once, the other job resumes it
    assert point("snapkv", 64) != point("snapkv", 256)


def test_block_wise_sweep_over_several_methods_sets_the_shared_schedule(tmp_path):
    result = kvbench("-m", *TINY, "task.num_samples=1", "method=snapkv,h2o,keydiff", "++method.block_size=16",
                     "budget=32", f"results_dir={tmp_path}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    points = records(tmp_path)
    assert len(points) == 3
    for (record,) in points.values():
        assert record["eviction_schedule"]["events"] == ["prefill_block", "decode_step"]
        assert record["method_params"]["block_size"] == 16 and not record["prefill_reused"]
        assert record["kv_peak_entries_per_head"] <= 32 + 16 and record["kept_tokens_end_max"] == 32


def test_the_same_point_started_twice_at_once_records_each_sample_once(tmp_path):
    args = ["model=tiny_llama", "task=twostage_retr", "task.num_samples=40", "task.max_new_tokens=8",
            "engine.nll=false", "method=snapkv", "budget=48", f"results_dir={tmp_path}", "show_progress=false"]
    procs = [subprocess.Popen([sys.executable, "-m", "kvbench", *args], cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [proc.communicate(timeout=600) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outputs
    (point, recs), = records(tmp_path).items()
    ids = [r["sample_id"] for r in recs]
    assert len(ids) == 40 and len(set(ids)) == 40, "a sample was recorded twice"
    said = [out + err for out, err in outputs]
    assert any("is being run by another process" in text for text in said), "the second process must say it waited"


@pytest.mark.parametrize("multirun", [False, True], ids=["run", "multirun"])
def test_ctrl_c_says_how_to_resume_without_a_traceback(tmp_path, multirun):
    args = [*(["-m", "method=full,snapkv", "budget=64"] if multirun else []), *TINY, "task.num_samples=400",
            f"results_dir={tmp_path}"]
    proc = subprocess.Popen([sys.executable, "-m", "kvbench", *args], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + 240
    while time.time() < deadline and sum(len(v) for v in records(tmp_path).values()) < 2:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C sends to the terminal's foreground process group
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130
    assert "Traceback" not in out + err
    assert "kvbench: interrupted: rerun the same command to resume" in err
    kept = sum(len(v) for v in records(tmp_path).values())
    assert 2 <= kept < 800
    if multirun:  # stopped in the grouped phase, before any job ended: its table still shows what is recorded
        table = out.split("(sweep did not finish: partial results)", 1)[1]
        assert "(no records)" not in table and "snapkv" in table, out


@pytest.mark.parametrize("where,reason", [("file", "File exists"), ("under_file", "Not a directory"),
                                          ("proc", "No such file or directory")])
def test_a_results_dir_that_cannot_hold_results_is_one_line(tmp_path, where, reason):
    (tmp_path / "file").write_text("not a directory")
    results_dir = {"file": tmp_path / "file", "under_file": tmp_path / "file" / "results",
                   "proc": Path("/proc/kvbench-results")}[where]
    result = kvbench("model=tiny_llama", f"results_dir={results_dir}", cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr + result.stdout
    (line,) = [line for line in result.stderr.splitlines() if line.strip()]
    assert line.startswith(f"kvbench: error: results_dir='{results_dir}' cannot hold results") and reason in line


def test_slurm_not_reachable_is_one_line_before_anything_is_submitted(tmp_path):
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    for tool in ("sbatch", "sinfo"):  # what Debian's slurm-client says without a slurm.conf
        (fake_bin / tool).write_text(f"#!/bin/sh\necho '{tool}: error: Could not establish a configuration "
                                     "source' >&2\nexit 1\n")
        (fake_bin / tool).chmod(0o755)
    env = {**os.environ, "PATH": f"{fake_bin}:{os.environ['PATH']}"}
    result = subprocess.run([sys.executable, "-m", "kvbench", "-m", "model=tiny_llama", "hydra/launcher=slurm",
                             f"results_dir={tmp_path / 'results'}"], cwd=tmp_path, capture_output=True, text=True,
                            env=env, timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr + result.stdout
    (line,) = [line for line in result.stderr.splitlines() if line.strip()]
    assert "SLURM is not reachable from here (sinfo: sinfo: error: Could not establish a configuration source)" in line
    assert "leave out hydra/launcher=slurm" in line
    assert not list(tmp_path.rglob(".submitit")) and not list(tmp_path.rglob(".hydra"))


def test_a_slurm_sweep_without_the_submitit_launcher_says_what_to_install(monkeypatch):
    import importlib.util

    from kvbench.config.command import check_command
    from kvbench.core.errors import KVBenchError

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *rest: None if name.endswith("hydra_submitit_launcher") else find_spec(name, *rest))
    with pytest.raises(KVBenchError, match=r"^hydra/launcher=slurm needs hydra-submitit-launcher: pip install "
                                           r"'kvbench\[slurm\]'$"):
        check_command(["-m", "model=tiny_llama", "hydra/launcher=slurm"])


def test_a_shared_setting_is_ignored_by_full_and_said(tmp_path):
    result = kvbench("-m", *TINY, "task.num_samples=1", "method=full,snapkv", "budget=64", "++method.block_size=128",
                     f"results_dir={tmp_path}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "method full compresses nothing: its points ignore method.block_size" in result.stdout + result.stderr
    params = {recs[0]["point"]["method"]: recs[0]["method_params"] for recs in records(tmp_path).values()}
    assert params["snapkv"]["block_size"] == 128 and "block_size" not in params["full"]


def test_a_sweeps_closing_table_lists_its_own_points_only(tmp_path):
    earlier = kvbench(*TINY, "task.num_samples=1", "method=streamingllm", "budget=32", f"results_dir={tmp_path}",
                      cwd=tmp_path)
    assert earlier.returncode == 0, earlier.stderr[-2000:]
    result = kvbench("-m", *TINY, "task.num_samples=1", "method=full,snapkv", "budget=64", f"results_dir={tmp_path}",
                     cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    table = result.stdout.split(f"Results of sweep {tmp_path}", 1)[1]
    assert "snapkv" in table and "full" in table and "streamingllm" not in table
    assert len(records(tmp_path)) == 3


def test_runs_from_the_folder_that_contains_the_checkout(tmp_path):
    """There `kvbench` on the import path is first the checkout folder, whose results/ would be kvbench.results."""
    (tmp_path / "kvbench").symlink_to(Path(__file__).resolve().parents[1], target_is_directory=True)
    result = kvbench("model=tiny_llama", "budget=1.0", cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "kvbench: error: budget=1.0 is ambiguous" in result.stderr


def test_python_in_the_folder_that_holds_the_checkout_imports_the_installed_package(tmp_path):
    """The working directory leads the import path, and its clone named kvbench has no __init__.py: Python takes
    the regular package of a later path entry (an editable install's: the checkout) over such a folder."""
    show = "import kvbench, kvbench.results, kvbench.conf; print(kvbench.__file__, kvbench.results.__file__)"
    elsewhere = subprocess.run([sys.executable, "-c", show], cwd=tmp_path, capture_output=True, text=True)
    (tmp_path / "kvbench").symlink_to(Path(__file__).resolve().parents[1], target_is_directory=True)
    beside = subprocess.run([sys.executable, "-c", show], cwd=tmp_path, capture_output=True, text=True)
    assert elsewhere.returncode == 0 and "None" not in elsewhere.stdout, elsewhere.stderr[-2000:]
    assert beside.returncode == 0 and beside.stdout == elsewhere.stdout, beside.stderr[-2000:]


def test_a_point_whose_samples_are_now_generated_differently_is_refused_not_mixed(tmp_path):
    args = (*TINY, "task.num_samples=2", "method=snapkv", "budget=64", f"results_dir={tmp_path}")
    assert kvbench(*args, cwd=tmp_path).returncode == 0
    (path,) = tmp_path.rglob("records.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert all(len(r["sample_digest"]) == 64 for r in rows)
    # what an older generator left behind: the first sample's record computed on another prompt
    rows[0]["sample_digest"] = "0" * 64
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[:1]))
    before = path.read_bytes()
    result = kvbench(*args, cwd=tmp_path)
    assert result.returncode == 2
    assert "generates differently: move that directory away" in result.stderr
    assert path.read_bytes() == before  # nothing added, nothing lost
    # a record from before records carried a digest resumes as before
    del rows[0]["sample_digest"]
    path.write_text(json.dumps(rows[0]) + "\n")
    assert kvbench(*args, cwd=tmp_path).returncode == 0
    assert [json.loads(line)["sample_id"] for line in path.read_text().splitlines()] == [r["sample_id"] for r in rows]


# `python -m kvbench` with each point's run replaced by a line naming it: the points a multirun launches, counted
# through check_command, Hydra's sweeper and kvbench's launcher as a real sweep goes through them.
LAUNCH_COUNTER = """
import importlib
import sys

import kvbench.run.group as group

cli = importlib.import_module("kvbench.cli.main")  # the module (kvbench.cli exports its main function as `main`)

def run_point(cfg):
    print("LAUNCHED", cfg.method.name, cfg.method.get("block_size"), cfg.method.get("prefill_chunk"), cfg.budget,
          flush=True)
    return {}

cli.run_point = run_point
group.run_grouped = lambda points, max_group: None  # the grouped decode: nothing to decode
sys.argv = ["kvbench", *sys.argv[1:]]
cli.main()
"""


def launched_points(tmp_path: Path, *args: str) -> list[tuple[str, ...]]:
    result = subprocess.run([sys.executable, "-c", LAUNCH_COUNTER, "-m", *args, f"results_dir={tmp_path / 'r'}",
                             "show_progress=false"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return sorted(tuple(line.split()[1:]) for line in result.stdout.splitlines() if line.startswith("LAUNCHED"))


def test_a_narrowed_method_setting_launches_each_point_once(tmp_path):
    """Issue 65: a method setting the preset sweeps, narrowed on the command line, launches each point once, at the
    command's value: keydiff_table12_cpu sweeps `method.block_size: 64,256`, omnikv_table14_cpu
    `++method.prefill_chunk: 512` (another spelling of the key). Counted where Hydra launches them."""
    assert launched_points(tmp_path, "experiment=keydiff_table12_cpu", "method=keydiff,snapkv_block", "budget=256",
                           "method.block_size=64") == [("keydiff", "64", "None", "256"),
                                                       ("snapkv", "64", "None", "256")]
    assert launched_points(tmp_path, "experiment=omnikv_table14_cpu", "method=full,omnikv_prefill_mem_r1",
                           "method.prefill_chunk=256,1024") == [
        ("full", "None", "1024", "0.3"), ("full", "None", "256", "0.3"), ("omnikv", "None", "1024", "0.3"),
        ("omnikv", "None", "256", "0.3")]


def test_a_swept_key_given_with_another_prefix_takes_the_presets_spelling():
    """Hydra's sweeper tells `method.x`, `+method.x` and `++method.x` apart: a command-line key that a preset
    sweeps under another spelling takes the preset's, as a sweep (one value: `choice(V)`), so that the sweep has
    one axis for it and each point runs once."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    from kvbench.config.command import narrowed_preset_sweeps

    params = {"+method.x": "1,2", "method.y": "a,b", "++method.z": "3,4", "budget": "64,128"}
    base = OmegaConf.create({"hydra": {"sweeper": {"params": params}}})
    argv = ["-m", "++method.x=5", "++method.y=a", "method.z=7,8", "++method.w=1", "~method.y", "budget=64"]
    assert narrowed_preset_sweeps(argv, base) == [
        "-m", "+method.x=choice(5)", "method.y=choice(a)", "++method.z=7,8", "++method.w=1", "~method.y",
        "budget=64"]
    lines = [f"{k}={v}" for k, v in params.items()] + narrowed_preset_sweeps(argv[1:5] + argv[6:], base)
    jobs = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(lines), None)[0]
    assert len(jobs) == 2 and {tuple(sorted(job)) for job in jobs} == {  # method.z's two values, once each
        ("++method.w=1", "++method.z=7", "+method.x=5", "budget=64", "method.y=a"),
        ("++method.w=1", "++method.z=8", "+method.x=5", "budget=64", "method.y=a")}


def test_a_point_that_two_jobs_of_a_sweep_name_prints_its_summary_once(tmp_path):
    """`method=full,snapkv budget=64,128`: full compresses nothing, so its two jobs are one point (one directory,
    one set of records); its summary is printed once, and the second job says it is the same point."""
    result = kvbench("-m", *TINY, "task.num_samples=1", "method=full,snapkv", "budget=64,128",
                     f"results_dir={tmp_path}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = result.stdout + result.stderr
    assert out.count("full budget=- on twostage_retr") == 1
    assert out.count("snapkv budget=64 on") == 1 and out.count("snapkv budget=128 on") == 1
    assert out.count("the same point as an earlier job of this sweep, summary above") == 1
    assert len(records(tmp_path)) == 3


@pytest.mark.parametrize("value", ["", "null", "' '"])
def test_an_empty_results_dir_is_refused(value):
    """`results_dir=` made Hydra's point directory `/<task>/...`: records at the file system's root."""
    from kvbench.config.command import check_job
    from kvbench.config.paths import compose_config
    from kvbench.core.errors import KVBenchError

    with pytest.raises(KVBenchError, match="^results_dir must name a directory"):
        check_job(compose_config(["model=tiny_llama", f"results_dir={value}"]))


def test_a_multirun_flag_among_the_overrides_goes_first():
    """`model=x -m method=a,b`: Hydra's parser took the overrides after -m for unrecognized arguments."""
    from kvbench.config.command import check_command

    argv = check_command(["model=tiny_llama", "task=twostage_retr", "-m", "method=full,snapkv", "budget=64"])
    assert argv == ["-m", "model=tiny_llama", "task=twostage_retr", "method=full,snapkv", "budget=64"]
