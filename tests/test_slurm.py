"""`hydra/launcher=slurm` on a real single-node SLURM cluster brought up by scripts/slurm_local_cluster.sh.

The cluster is installed from Debian's packages when they are missing and this is a root Debian machine (CI);
elsewhere, without SLURM, the test skips and says why. Set KVBENCH_SLURM_INSTALL=0 to never install.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "slurm_local_cluster.sh"
SAMPLES = 30  # enough that a cancelled point is still running when SIGKILL follows SIGTERM (KillWait)
SWEEP = ["-m", "model=tiny_llama", "task=twostage_retr", f"task.num_samples={SAMPLES}", "task.max_new_tokens=8",
         "engine.nll=false", "method=full,snapkv,adakv", "budget=64", "show_progress=false",
         "hydra/launcher=slurm_local"]


@pytest.fixture(scope="module")
def slurm_env(tmp_path_factory):
    if importlib_missing("hydra_plugins.hydra_submitit_launcher"):
        pytest.skip("hydra-submitit-launcher is not installed (pip install 'kvbench[slurm]')")
    can_install = (os.environ.get("KVBENCH_SLURM_INSTALL", "1") != "0" and os.geteuid() == 0
                   and shutil.which("apt-get") is not None)
    if shutil.which("slurmctld") is None and not can_install:
        pytest.skip("SLURM is not installed and cannot be installed here (needs root and apt-get)")
    cluster = tmp_path_factory.mktemp("slurm")
    up = subprocess.run(["bash", str(SCRIPT), "up", str(cluster), "--install" if can_install else ""],
                        capture_output=True, text=True, timeout=600)
    if up.returncode != 0:
        pytest.skip(f"could not bring up a local SLURM cluster: {(up.stderr or up.stdout).strip()[-500:]}")
    env = dict(os.environ, SLURM_CONF=str(cluster / "slurm.conf"))
    yield env
    subprocess.run(["bash", str(SCRIPT), "down", str(cluster)], capture_output=True, timeout=60)


def importlib_missing(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is None
    except ModuleNotFoundError:
        return True


def records(root: Path) -> dict[str, list[str]]:
    return {str(p.parent.relative_to(root)): [json.loads(line)["sample_id"] for line in p.read_text().splitlines()]
            for p in root.rglob("records.jsonl")}


def sweep(results: Path, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kvbench", *SWEEP, f"results_dir={results}"], cwd=results,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def test_slurm_sweep_survives_a_cancelled_job_and_resumes_on_resubmission(slurm_env, tmp_path):
    # 1. submit; once a point is half-recorded, cancel the array task running it (a preemption or a crash)
    proc = sweep(tmp_path, slurm_env)
    cancelled = None
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        for point, ids in records(tmp_path).items():
            if 2 <= len(ids) < SAMPLES:
                env = json.loads((tmp_path / point / "manifest.json").read_text())["env"]
                assert env["SLURM_ARRAY_JOB_ID"], "the manifest must locate the point's SLURM job"
                cancelled = (point, f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}")
                subprocess.run(["scancel", cancelled[1]], env=slurm_env, check=True, timeout=30)
                break
        if cancelled:
            break
        time.sleep(0.2)
    assert cancelled, "no point was caught half-way; the sweep output was:\n" + (proc.communicate()[0] or "")
    # the submitting process reports the failed task once the others finish; without slurmdbd (sacct) submitit
    # may not learn the cancelled task's state, so it is stopped once no task of the sweep is left in the queue
    while time.time() < deadline and proc.poll() is None:
        queue = subprocess.run(["squeue", "-h", "-o", "%i"], env=slurm_env, capture_output=True, text=True).stdout
        if not queue.strip():
            time.sleep(5)  # its last poll
            break
        time.sleep(0.5)
    if proc.poll() is None:
        os.killpg(proc.pid, 9)
    first_output = proc.communicate()[0]
    before = records(tmp_path)
    assert len(before[cancelled[0]]) < SAMPLES, "the cancelled point must be incomplete: " + first_output[-2000:]

    # 2. resubmit the same command: the cancelled point resumes, finished points are skipped
    proc = sweep(tmp_path, slurm_env)
    output = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0, output[-3000:]
    after = records(tmp_path)
    assert len(after) == 3
    for point, ids in after.items():
        assert len(ids) == SAMPLES and len(set(ids)) == SAMPLES, f"{point}: {ids}"
        assert ids[: len(before.get(point, []))] == before.get(point, []), "recorded samples must not be redone"
    manifests = [json.loads(p.read_text()) for p in tmp_path.rglob("manifest.json")]
    assert all(m["env"]["SLURM_JOB_ID"] for m in manifests), "every point ran as a SLURM job"
    resumed = json.loads((tmp_path / cancelled[0] / "manifest.json").read_text())
    assert resumed.get("resumes"), "the resubmitted job must have resumed the cancelled point"
    assert "Results of sweep" in output


def test_slurm_array_tasks_of_grouped_points_record_what_a_task_per_point_records(slurm_env, tmp_path):
    """`hydra.launcher.max_group=3`: the sweep's three points go to one array task, which decodes them together (one
    model load, one dense prefill per prompt, batched decode); their records equal a task per point's, bit for bit."""
    small = [arg for arg in SWEEP if not arg.startswith("task.num_samples=")] + ["task.num_samples=3"]
    runs = {}
    for name, extra in (("alone", []), ("grouped", ["hydra.launcher.max_group=3"])):
        root = tmp_path / name
        root.mkdir()
        done = subprocess.run([sys.executable, "-m", "kvbench", *small, *extra, f"results_dir={root}"], cwd=root,
                              env=slurm_env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        runs[name] = root
    tasks = {name: sorted(p.name for p in root.glob(".submitit/*/*_log.out")) for name, root in runs.items()}
    assert len(tasks["alone"]) == 3 and len(tasks["grouped"]) == 1, tasks
    alone, grouped = ({(str(p.parent.relative_to(root)), r["sample_id"]): r for p in root.rglob("records.jsonl")
                       for r in map(json.loads, p.read_text().splitlines())} for root in runs.values())
    assert set(alone) == set(grouped) and len(grouped) == 9
    for key, record in grouped.items():
        assert record["decode_batched_rows"] == 3 and alone[key]["decode_batched_rows"] == 1
        for field in ("score", "kv_bytes_end", "kept_tokens_end_max", "eviction_events"):
            assert record[field] == alone[key][field], (key, field)
        assert [t["prediction"] for t in record["turns"]] == [t["prediction"] for t in alone[key]["turns"]]
    manifests = [json.loads(p.read_text()) for p in runs["grouped"].rglob("manifest.json")]
    assert len(manifests) == 3 and len({m["env"]["SLURM_JOB_ID"] for m in manifests}) == 1  # one task ran them all
