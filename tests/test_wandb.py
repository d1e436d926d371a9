"""`logger=wandb` in offline mode: the run files W&B writes hold the point's config, records and metrics."""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("wandb")

TINY = ["model=tiny_llama", "task=twostage_retr", "task.num_samples=2", "task.max_new_tokens=4", "engine.nll=false",
        "show_progress=false"]


def wandb_records(path: Path) -> list:
    """The protobuf records of a `.wandb` transaction log (LevelDB log format: 32 KiB blocks of chunks with a
    7-byte header (crc, length, type) after a 7-byte file header)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, payload, records = 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:  # block padding
            pos += left
            continue
        payload += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST chunk
            record = pb.Record()
            record.ParseFromString(payload)
            records.append(record)
            payload = b""
    return records


def test_offline_run_holds_config_records_and_metrics(tmp_path: Path) -> None:
    env = {**os.environ, "WANDB_SILENT": "true"}
    env.pop("WANDB_API_KEY", None)
    result = subprocess.run([sys.executable, "-m", "kvbench", "-m", *TINY, "method=snapkv,streamingllm", "budget=64",
                             "logger=wandb", "logger.mode=offline", "logger.group=test-sweep",
                             f"results_dir={tmp_path}"], cwd=tmp_path, capture_output=True, text=True, env=env,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    logs = sorted(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(logs) == 2, "one W&B run per point"
    seen_methods = set()
    for log in logs:
        records = wandb_records(log)
        (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
        assert run.run_group == "test-sweep" and run.project == "kvbench" and run.job_type == "point"
        config = {item.key: json.loads(item.value_json) for item in run.config.update}
        assert config["budget"] == 64 and config["model"]["name"] == "tiny_llama"
        assert config["task"]["num_samples"] == 2 and "logger" not in config
        seen_methods.add(config["method"]["name"])
        summary = {}
        for r in records:
            if r.WhichOneof("record_type") == "summary":
                for item in r.summary.update:
                    summary[item.key or ".".join(item.nested_key)] = json.loads(item.value_json)
        assert summary["n_samples"] == 2 and "score" in summary and summary["method"] == config["method"]["name"]
        assert summary["kept_tokens_mean"] > 0 and summary["decode_ms_per_token"] > 0
        assert summary["records.nrows"] == 2 and summary["records._type"] == "table-file"
        tables = list(log.parent.glob("files/media/table/records_*.table.json"))
        assert tables and len(json.loads(tables[0].read_text())["data"]) == 2
    assert seen_methods == {"snapkv", "streamingllm"}


def test_report_publish_without_network_says_so_and_writes_the_static_report(tmp_path: Path) -> None:
    from kvbench.results.store import RecordStore

    point = {"model": "m", "task": "qa", "method": "snapkv", "budget": 64}
    RecordStore(tmp_path / "p").append({"sample_id": "a", "task": "qa", "score": 1.0, "point": point,
                                        "point_hash": "abc"})
    env = {**os.environ, "WANDB_BASE_URL": "https://wandb.invalid"}
    result = subprocess.run([sys.executable, "-m", "kvbench", "report", str(tmp_path), "wandb.publish=true"],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    said = [line for line in result.stdout.splitlines() if "W&B report" in line]
    assert len(said) == 1 and "not published" in said[0] and "wandb.invalid" in said[0]
    assert (tmp_path / "report" / "index.html").is_file() and (tmp_path / "report" / "table.md").is_file()


def _online_env(tmp_path: Path, base_url: str, key: bool = True) -> dict:
    """An environment whose W&B settings are the test's alone: its server, a key or none (no .netrc, no settings)."""
    env = {**os.environ, "WANDB_BASE_URL": base_url, "WANDB_INIT_TIMEOUT": "5", "WANDB_SILENT": "true",
           "NETRC": str(tmp_path / "no-netrc"), "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config")}
    env.pop("WANDB_MODE", None)
    env.pop("WANDB_API_KEY", None)
    if key:
        env["WANDB_API_KEY"] = "x" * 40
    return env


def _online_sweep(tmp_path: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvbench", "-m", *TINY, "method=snapkv,streamingllm", "budget=64",
                           "logger=wandb", "logger.mode=online", f"results_dir={tmp_path / 'results'}"], cwd=tmp_path,
                          capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.parametrize("problem", ["no server", "no key"])
def test_online_logging_that_cannot_work_from_here_is_one_line_before_anything_runs(tmp_path: Path, problem) -> None:
    """No server answering, or no API key: every point would warn after it ran (and first wait out W&B's init
    timeout), so the command stops before any point, in one line naming the way out."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        answering = f"http://127.0.0.1:{server.getsockname()[1]}"
        env = _online_env(tmp_path, "http://127.0.0.1:9" if problem == "no server" else answering,
                          key=problem == "no server")
        result = _online_sweep(tmp_path, env)
    assert result.returncode == 2, result.stderr[-3000:]
    said = {"no server": "its server http://127.0.0.1:9 does not answer", "no key": "no W&B API key (run `wandb login`"}
    lines = [line for line in result.stderr.splitlines() if line.startswith("kvbench: error:")]
    assert len(lines) == 1 and said[problem] in lines[0] and "logger.mode=offline" in lines[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr and not list(tmp_path.glob("results/*"))  # no point directory


def test_online_logging_that_fails_after_the_check_warns_and_the_sweep_goes_on(tmp_path: Path) -> None:
    """A server that takes the connection but never answers W&B (a network that breaks after the command's check):
    each point warns once, after its records are written, and the sweep goes on."""
    with socket.socket() as server:  # listening, never accepting: connections open, requests wait
        server.bind(("127.0.0.1", 0))
        server.listen()
        result = _online_sweep(tmp_path, _online_env(tmp_path, f"http://127.0.0.1:{server.getsockname()[1]}"))
    assert result.returncode == 0, result.stderr[-3000:]
    warnings = [line for line in (result.stdout + result.stderr).splitlines() if "W&B logging failed" in line]
    assert len(warnings) == 2 and all("records are safe" in w and "logger.mode=offline" in w for w in warnings)
    assert "Traceback" not in result.stdout + result.stderr
    assert len(list(tmp_path.rglob("records.jsonl"))) == 2


def test_logger_wandb_without_the_wandb_package_is_one_line(monkeypatch) -> None:
    import importlib.util

    from omegaconf import OmegaConf

    from kvbench.config import command
    from kvbench.core.errors import KVBenchError

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *rest: None if name == "wandb" else find_spec(name, *rest))
    with pytest.raises(KVBenchError, match=r"logger=wandb needs the wandb package: pip install 'kvbench\[wandb\]'"):
        command.check_logger(OmegaConf.create({"name": "wandb", "mode": "offline"}))
    command.check_logger(OmegaConf.create({"name": "none"}))  # no W&B asked for: nothing looked up


def test_a_mode_w_and_b_does_not_have_is_one_line() -> None:
    """`logger.mode=ofline` was taken as online (and refused for want of a server, naming the wrong cause)."""
    from omegaconf import OmegaConf

    from kvbench.config import command
    from kvbench.core.errors import KVBenchError

    with pytest.raises(KVBenchError, match="^logger.mode must be online, offline, disabled .*got 'ofline'$"):
        command.check_logger(OmegaConf.create({"name": "wandb", "mode": "ofline"}))
