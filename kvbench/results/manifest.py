"""The environment a point was computed in (versions, git sha, hardware, seed); resumes elsewhere are appended."""

from __future__ import annotations

import datetime
import importlib.metadata
import importlib.util
import json
import logging
import os
import platform
import socket
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvbench.results.store import _atomic_write_json, to_jsonable

log = logging.getLogger(__name__)


MANIFEST_FILE = "manifest.json"


# Distributions whose versions can change a result; a missing one is recorded as null, not skipped, so that
# "not installed" is distinguishable from "not recorded".
MANIFEST_PACKAGES = ("torch", "transformers", "hydra-core", "datasets", "triton", "numpy", "pandas", "kvbench")


# Environment variables that locate a run on a cluster or restrict its devices.
MANIFEST_ENV = ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "CUDA_VISIBLE_DEVICES")


# Manifest keys that, when they differ between the first run and a resume, mean the point mixes environments.
RESUME_CHECKED_KEYS = ("git_sha", "git_dirty", "versions", "python", "gpus", "decode_attention")


def git_state(path: Path) -> tuple[str | None, bool | None]:
    """(HEAD sha, dirty flag) of the git work tree containing `path`; (None, None) outside one.

    Dirty includes untracked, non-ignored files: new code that is not committed can change a result. A path
    that git ignores (a package installed into a venv inside some repo) is not that repo's code: (None, None).
    """
    def git(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["git", "-C", str(path), *args], capture_output=True, text=True, timeout=30)

    try:
        if git("rev-parse", "--is-inside-work-tree").stdout.strip() != "true":
            return None, None
        if git("check-ignore", "-q", str(path)).returncode == 0:
            return None, None
        head = git("rev-parse", "--verify", "-q", "HEAD")
        status = git("status", "--porcelain")
    except (OSError, subprocess.SubprocessError):  # git missing or hung
        return None, None
    sha = head.stdout.strip() if head.returncode == 0 else None  # None: a repo without commits
    return sha, (bool(status.stdout.strip()) if status.returncode == 0 else None)


def _cpu_model() -> str | None:
    """The CPU's marketing name, which `platform.processor()` leaves empty on Linux."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


# CPU features that pick kernels, and so change float results in the last digits (MKL's and ATen's code paths,
# the bf16 decode attention): records of one point agree bitwise only between machines with the same ones.
KERNEL_CPU_FEATURES = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16")


def _cpu_features() -> list[str] | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return [name for name in KERNEL_CPU_FEATURES if name in flags]
    except OSError:
        pass
    return None


def _total_ram_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _torch_devices() -> dict[str, Any]:
    """CUDA version and GPUs as torch sees them (CUDA_VISIBLE_DEVICES applied); empty without torch."""
    if importlib.util.find_spec("torch") is None:
        return {"cuda": None, "gpus": []}
    import torch

    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            gpus.append({"name": props.name, "total_memory_bytes": props.total_memory})
    return {"cuda": torch.version.cuda, "gpus": gpus}


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def build_manifest(seed: int, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Describe the environment computing a point, so a result can be traced to code, versions and hardware.

    `extra` adds caller facts (point hash, resolved point); it may not shadow a built-in key, so a manifest
    field always means the same thing.
    """
    try:
        cpus_available: int | None = len(os.sched_getaffinity(0))  # what SLURM actually granted
    except AttributeError:
        cpus_available = None
    sha, dirty = git_state(Path(__file__).resolve().parent)
    manifest: dict[str, Any] = {
        "timestamp_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "seed": seed,
        "argv": list(sys.argv),
        "cwd": os.getcwd(),
        "hostname": socket.gethostname(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": {"model": _cpu_model(), "count": os.cpu_count(), "available": cpus_available,
                "features": _cpu_features()},
        "ram_bytes": _total_ram_bytes(),
        **_torch_devices(),
        "versions": {dist: _version(dist) for dist in MANIFEST_PACKAGES},
        "git_sha": sha,
        "git_dirty": dirty,
        "env": {name: os.environ.get(name) for name in MANIFEST_ENV},
    }
    for key, value in (extra or {}).items():
        if key in manifest:
            raise ValueError(f"extra manifest key {key!r} would shadow a built-in field")
        manifest[key] = value
    return manifest


def write_manifest(run_dir: Path, manifest: Mapping[str, Any]) -> dict[str, Any]:
    """Store `manifest` in the run directory and return what is stored.

    The first run's manifest is never replaced: a resume appends its manifest to ``resumes`` and warns when
    code, versions or hardware differ, because the point's records then come from mixed environments.
    """
    path = Path(run_dir) / MANIFEST_FILE
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    if not path.exists():
        stored = dict(manifest)
    else:
        stored = json.loads(path.read_text(encoding="utf-8"))  # corrupt: raise, a human must look
        changed = [k for k in RESUME_CHECKED_KEYS if to_jsonable(manifest.get(k)) != stored.get(k)]
        if changed:
            log.warning("%s: resuming in a different environment (%s differ); the point mixes environments",
                        run_dir, ", ".join(changed))
        stored.setdefault("resumes", []).append(dict(manifest))
    _atomic_write_json(path, stored)
    return stored
