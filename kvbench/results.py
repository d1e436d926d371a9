"""Per-point result storage: records, manifest and summary of one run directory.

One experiment point (model, task, method, budget, engine settings, seed, ...) is one Hydra job and one run
directory at a deterministic path, so re-running the same command finds the work already done. The run
directory holds:

- ``records.jsonl``: one JSON line per evaluated sample, appended as it finishes. A preempted job resumes by
  skipping the sample ids already there, so the file is the only state that has to survive a crash; see
  `RecordStore` for how appends stay whole lines under kills and racing writers.
- ``manifest.json``: the environment the point was computed in (versions, git sha, hardware). A resume on
  another machine or commit is appended to its ``resumes`` list rather than overwriting it, so a point
  computed with mixed code is visible.
- ``summary.json``: aggregate scores, recomputable at any time from the records with `summarize`.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import math
import os
import platform
import socket
import subprocess
import sys
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pandas as pd

log = logging.getLogger(__name__)

RECORDS_FILE = "records.jsonl"
MANIFEST_FILE = "manifest.json"
SUMMARY_FILE = "summary.json"

# Distributions whose versions can change a result; a missing one is recorded as null, not skipped, so that
# "not installed" is distinguishable from "not recorded".
MANIFEST_PACKAGES = ("torch", "transformers", "hydra-core", "datasets", "triton", "numpy", "pandas", "kvbench")
# Environment variables that locate a run on a cluster or restrict its devices.
MANIFEST_ENV = ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "CUDA_VISIBLE_DEVICES")
# Manifest keys that, when they differ between the first run and a resume, mean the point mixes environments.
RESUME_CHECKED_KEYS = ("git_sha", "git_dirty", "versions", "python", "gpus")
# Record fields that are identity or structure, never averaged as metrics.
NON_METRIC_FIELDS = frozenset({"sample_id", "task", "score", "turns", "point", "point_hash"})


def to_jsonable(obj: Any, *, where: str = "", strict: bool = False) -> Any:
    """Convert `obj` to plain JSON types, so numpy/torch scalars from the engine serialise.

    Non-finite floats have no JSON representation: with ``strict`` they raise (a hash must not silently
    change meaning), otherwise they become null with a warning naming the field (`where`), because one
    diverged metric should not cost the whole sample.
    """
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        if math.isfinite(obj):
            return float(obj)
        if strict:
            raise ValueError(f"non-finite value {obj!r} at {where or 'top level'}")
        log.warning("non-finite value %r at %s written as null", obj, where or "top level")
        return None
    if isinstance(obj, Mapping):
        return {str(k): to_jsonable(v, where=f"{where}.{k}" if where else str(k), strict=strict)
                for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v, where=f"{where}[{i}]", strict=strict) for i, v in enumerate(obj)]
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if hasattr(obj, "tolist"):  # numpy scalars/arrays, torch tensors (0-d ones give a Python scalar)
        return to_jsonable(obj.tolist(), where=where, strict=strict)
    raise TypeError(f"cannot serialise {type(obj).__name__} at {where or 'top level'} to JSON")


def point_hash(cfg: Mapping[str, Any]) -> str:
    """Identify an experiment point by its defining config: 12 hex digits of sha256 of canonical JSON.

    Keys are sorted and separators fixed so the hash does not depend on dict order or formatting. Values are
    compared by JSON type: ``1`` and ``1.0`` are different points, so pass the resolved config as composed.
    """
    canonical = json.dumps(to_jsonable(cfg, strict=True), sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:12]


@contextlib.contextmanager
def _flock(fd: int, exclusive: bool) -> Iterator[None]:
    """Advisory lock on `fd`, best effort: some cluster file systems (Lustre without ``flock``) refuse locks,
    and the appends stay whole lines without it; the lock only keeps the torn-tail repair of one process from
    truncating another process's append in flight."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
    except OSError as err:
        log.debug("flock unavailable (%s); continuing unlocked", err)
    yield  # the lock is released when the caller closes fd


def _parse_records(data: bytes, source: Path) -> list[dict[str, Any]]:
    """Records in the bytes of a records file, first occurrence of each sample id kept.

    An unterminated last chunk is not a record (a writer was killed mid-line, or is writing it now). Lines
    that are not a JSON object with a ``sample_id`` are skipped with a warning: that sample is then absent and
    gets recomputed, which is always safe. Duplicate ids can only come from two writers racing on one point;
    both computed the same sample, so the first is kept deterministically.
    """
    lines = data.split(b"\n")  # only "\n" ends a record; str.splitlines would also split on U+2028 etc.
    if lines[-1]:
        log.warning("%s: ignoring unterminated last line (%d bytes)", source, len(lines[-1]))
    records: list[dict[str, Any]] = []
    seen: set[str] = set()
    for lineno, line in enumerate(lines[:-1], start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            log.warning("%s:%d: skipping corrupt line (%s)", source, lineno, err)
            continue
        if not isinstance(rec, dict) or not isinstance(rec.get("sample_id"), str):
            log.warning("%s:%d: skipping line without a string sample_id", source, lineno)
            continue
        if rec["sample_id"] in seen:
            log.warning("%s:%d: duplicate sample_id %r ignored (keeping the first)", source, lineno, rec["sample_id"])
            continue
        seen.add(rec["sample_id"])
        records.append(rec)
    return records


def load_records(run_dir: Path) -> list[dict[str, Any]]:
    """Read a run directory's records without modifying anything, for reports on sweeps that may be live.

    Unlike opening a `RecordStore`, an unterminated last line is ignored, not truncated: it may be an append
    in flight from a running job.
    """
    path = Path(run_dir) / RECORDS_FILE
    return _parse_records(path.read_bytes(), path) if path.exists() else []


LOCK_FILE = ".lock"


@contextlib.contextmanager
def point_lock(run_dir: Path, wait: bool = True) -> Iterator[bool]:
    """Hold the point's lock (an exclusive `flock` on `run_dir/.lock`) while this process runs the point.

    Records of concurrent processes never interleave (see `RecordStore`), but two processes running the same
    point at once would both compute, and both append, the samples neither had finished. With the lock the
    second waits, says so, and then resumes from what the first recorded: every sample exactly once. With
    `wait=False` it yields False at once instead when another process holds the lock. The lock is released
    when the block ends or the process dies.
    """
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    fd = os.open(Path(run_dir) / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            if not wait:
                yield False
                return
            log.warning("%s is being run by another process (%s); waiting for it, then resuming", run_dir, holder)
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
        yield True
    finally:
        os.close(fd)  # releases the lock


class RecordStore:
    """Append-only JSONL store of per-sample records, safe against kills and racing writers.

    Each record is one line written by a single ``os.write`` on an ``O_APPEND`` descriptor, then fsynced: on
    a local file system the kernel positions and writes it as one unit, so concurrent writers never
    interleave, and a record that is readable was durable before the next sample started. A kill can still
    leave a torn last line (a short write, or an NFS client dying mid-flush); opening the store truncates it
    so the next append starts on a fresh line, and the lost sample is recomputed on resume.
    """

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / RECORDS_FILE
        self.run_dir.mkdir(parents=True, exist_ok=True)
        created = not self.path.exists()
        self._repair_tail()
        if created:  # make the new file's directory entry durable too
            dir_fd = os.open(self.run_dir, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)

    def _repair_tail(self) -> None:
        """Truncate a torn last line, so the next append does not glue a record onto its remains."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            with _flock(fd, exclusive=True):
                size = os.fstat(fd).st_size
                if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
                    return
                # Scan backwards for the last newline in blocks; the torn line is at most one record long.
                end = size
                keep = 0
                while end > 0:
                    start = max(0, end - 65536)
                    nl = os.pread(fd, end - start, start).rfind(b"\n")
                    if nl >= 0:
                        keep = start + nl + 1
                        break
                    end = start
                os.ftruncate(fd, keep)
                os.fsync(fd)
                log.warning("%s: removed torn last line (%d bytes, process killed mid-write?); that sample will "
                            "be recomputed", self.path, size - keep)
        finally:
            os.close(fd)

    def append(self, record: Mapping[str, Any]) -> None:
        """Durably add one sample's record; it must carry a string ``sample_id`` so resume can skip it."""
        sample_id = record.get("sample_id")
        if not isinstance(sample_id, str) or not sample_id:
            raise ValueError(f"record needs a non-empty string sample_id, got {sample_id!r}")
        line = json.dumps(to_jsonable(record, where=sample_id), ensure_ascii=True, allow_nan=False) + "\n"
        data = line.encode("utf-8")
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            with _flock(fd, exclusive=False):  # shared: appenders run together, only a tail repair waits
                written = os.write(fd, data)
                if written != len(data):
                    raise OSError(f"{self.path}: short write ({written} of {len(data)} bytes, disk full?); "
                                  "the torn line is removed when the store is next opened")
                os.fsync(fd)
        finally:
            os.close(fd)

    def records(self) -> list[dict[str, Any]]:
        """All records in file order, each sample id once."""
        return _parse_records(self.path.read_bytes(), self.path)

    def completed_ids(self) -> set[str]:
        """Sample ids already recorded: the samples a resumed job skips."""
        return {rec["sample_id"] for rec in self.records()}


def _atomic_write_json(path: Path, obj: Any) -> None:
    """Write JSON via a temp file and rename, so a kill never leaves a half-written manifest or summary."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(to_jsonable(obj), f, indent=2, sort_keys=True, allow_nan=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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
        "cpu": {"model": _cpu_model(), "count": os.cpu_count(), "available": cpus_available},
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


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _unscored(rec: dict[str, Any]) -> bool:
    """A record that has no score by design: synthetic efficiency inputs, or an out-of-memory point."""
    return bool(rec.get("oom")) or all(t.get("metric") == "none" for t in rec.get("turns") or [{}])


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _metric_means(records: list[dict[str, Any]]) -> dict[str, float]:
    """Mean of every numeric top-level field that is not identity or score, over the records having it."""
    values: dict[str, list[float]] = defaultdict(list)
    for rec in records:
        for key, value in rec.items():
            if key not in NON_METRIC_FIELDS and _is_number(value):
                values[key].append(float(value))
    return {key: sum(v) / len(v) for key, v in sorted(values.items())}


def _score_pct(records: list[dict[str, Any]]) -> float | None:
    """Mean score x100 over the records with a numeric score."""
    mean = _mean([float(r["score"]) for r in records if _is_number(r.get("score"))])
    return None if mean is None else 100.0 * mean


def _turn_scores(records: list[dict[str, Any]]) -> list[float | None]:
    """Mean score x100 of the i-th turn, over the samples that have one: degradation over a conversation."""
    per_turn: dict[int, list[float]] = defaultdict(list)
    for rec in records:
        for i, turn in enumerate(rec.get("turns") or []):
            if _is_number(turn.get("score")):
                per_turn[i].append(float(turn["score"]))
    n_turns = max(len(rec.get("turns") or []) for rec in records)
    return [100.0 * m if (m := _mean(per_turn[i])) is not None else None for i in range(n_turns)]


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Aggregate one point's records.

    ``score`` is the headline: the unweighted mean of the per-subtask mean scores (x100), the RULER/LongBench
    rule, so a suite's subtasks weigh the same whatever their sample counts; for a single task it equals
    ``score_micro``, the plain mean over samples. ``metrics`` are means of the other numeric record fields.
    ``tasks`` breaks everything down per subtask, plus per-turn scores for multi-turn tasks.
    """
    for rec in records:
        if not isinstance(rec.get("task"), str):
            raise ValueError(f"record {rec.get('sample_id')!r} has no task name")
        if not _is_number(rec.get("score")) and not _unscored(rec):
            log.warning("record %r has no numeric score; excluded from score means", rec.get("sample_id"))
    hashes = {rec["point_hash"] for rec in records if "point_hash" in rec}
    if len(hashes) > 1:
        raise ValueError(f"records from several points ({', '.join(sorted(hashes))}) cannot be summarised together")

    by_task: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for rec in records:
        by_task[rec["task"]].append(rec)
    tasks: dict[str, dict[str, Any]] = {}
    for name, recs in sorted(by_task.items()):
        tasks[name] = {"n": len(recs), "score": _score_pct(recs), "metrics": _metric_means(recs)}
        if any(len(r.get("turns") or []) > 1 for r in recs):
            tasks[name]["turn_scores"] = _turn_scores(recs)

    summary: dict[str, Any] = {
        "n_samples": len(records),
        "score": _mean([t["score"] for t in tasks.values() if t["score"] is not None]),
        "score_micro": _score_pct(records),
        "metrics": _metric_means(records),
        "tasks": tasks,
    }
    if records and "point" in records[0]:
        summary["point"] = records[0]["point"]
    if hashes:
        summary["point_hash"] = hashes.pop()
    return summary


def write_summary(run_dir: Path, summary: Mapping[str, Any]) -> None:
    """Store the summary atomically; it is derived data, so it is simply replaced on every update."""
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    _atomic_write_json(Path(run_dir) / SUMMARY_FILE, summary)


# --- reading a results tree as a table -------------------------------------------------------------------------

# Record fields that are not table columns: structure, or renamed (a record's `task` is its subtask).
_NESTED_RECORD_FIELDS = ("point", "turns", "task")
# Dict fields that are not flattened into columns: per-sample task data (needle offsets, ...).
_UNFLATTENED_RECORD_FIELDS = ("point", "meta")
# Sections and keys of a run directory's config.yaml that become columns (`method.window`, `task.seq_len`, ...):
# the names a sweep overrides, so a preset's grid can be matched against the records.
CONFIG_COLUMNS = ("model", "method", "task", "engine", "budget", "compression_ratio", "compress_question", "seed",
                  "profile", "profiler")
# Per-sample task data kept as columns: NIAH's cell (length, depth), Math-500's generation limit.
META_COLUMNS = ("length", "depth", "seq_len")


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    """Flatten nested dicts into dotted columns; lists become JSON text so they can be group keys."""
    if isinstance(value, dict):
        for key, sub in value.items():
            _flatten(f"{prefix}.{key}" if prefix else str(key), sub, out)
    elif isinstance(value, list):
        out[prefix] = json.dumps(value)
    else:
        out[prefix] = value


def _run_config(run_dir: Path) -> dict[str, Any]:
    """The run directory's resolved config (config.yaml), flattened; empty when it has none."""
    import yaml

    path = run_dir / "config.yaml"
    try:
        cfg = yaml.safe_load(path.read_text(encoding="utf-8")) if path.exists() else None
    except (OSError, yaml.YAMLError) as err:
        log.warning("%s: unreadable config (%s); its config columns are left empty", path, err)
        cfg = None
    flat: dict[str, Any] = {}
    for key in CONFIG_COLUMNS:
        if isinstance(cfg, dict) and key in cfg:
            _flatten(key, cfg[key], flat)
    # the config files the point was composed from (`method=snapkv_head` is SnapKV with per-head selection):
    # what a sweep names, so what a report matches and shows
    hydra_file = run_dir / ".hydra" / "hydra.yaml"
    if hydra_file.exists():
        try:
            choices = (yaml.safe_load(hydra_file.read_text(encoding="utf-8")) or {}).get("hydra", {}).get(
                "runtime", {}).get("choices", {})
        except (OSError, yaml.YAMLError):
            choices = {}
        flat.update({f"choice.{k}": v for k, v in choices.items() if k in ("model", "method", "task", "experiment")})
    return flat


def collect(results_root: Path) -> "pd.DataFrame":
    """One row per record under `results_root`: its fields, its point's identity, its run's config and its
    subtask. Reading never modifies a run directory (see `load_records`), so it is safe on a live sweep.

    A record's ``task`` is its subtask (``subtask`` column); the point's ``task`` is the task config (a suite
    name for suites). ``attrs["point_columns"]`` lists the columns that came from point identities. Nested
    record fields are dotted columns (``profile.ttft_s``); the run's config adds ``method.window``,
    ``task.seq_len``, ... where no record field has that name; per-head lists stay JSON text.
    """
    import pandas as pd

    root = Path(results_root)
    rows: list[dict[str, Any]] = []
    point_columns: dict[str, None] = {}  # ordered set
    for path in sorted(root.rglob(RECORDS_FILE)):
        run_dir = path.parent
        config = _run_config(run_dir)
        for rec in load_records(run_dir):
            row = {k: v for k, v in rec.items() if k not in _NESTED_RECORD_FIELDS and not isinstance(v, (dict, list))}
            for key, value in rec.items():  # e.g. budget_plan.k1, eviction_schedule.block_size
                if isinstance(value, dict) and key not in _UNFLATTENED_RECORD_FIELDS:
                    _flatten(key, value, row)
                elif isinstance(value, list) and key not in _NESTED_RECORD_FIELDS:
                    row[key] = json.dumps(value)
            extra: dict[str, list[float]] = defaultdict(list)  # a task's secondary metrics (Math-500 exact match)
            for turn in rec.get("turns") or []:
                for name, value in (turn.get("extra_scores") or {}).items():
                    if _is_number(value):
                        extra[name].append(float(value))
            row.update({f"extra.{name}": sum(v) / len(v) for name, v in extra.items()})
            meta = rec.get("meta") or {}
            row.update({f"meta.{k}": meta[k] for k in META_COLUMNS if k in meta})
            row["subtask"] = rec.get("task")
            row["n_turns"] = len(rec.get("turns") or [])
            point: dict[str, Any] = {}
            _flatten("", rec.get("point") or {}, point)
            point_columns.update(dict.fromkeys(point))
            row.update(point)
            for key, value in config.items():
                row.setdefault(key, value)
            row["run_dir"] = str(run_dir.relative_to(root))
            rows.append(row)
    df = pd.DataFrame(rows)
    df.attrs["point_columns"] = list(point_columns)
    df.attrs["root"] = str(root)
    return df


def experiments() -> list[str]:
    """The experiment presets (conf/experiment/*.yaml)."""
    from kvbench.cli import CONF_DIR

    return sorted(p.stem for p in (Path(CONF_DIR) / "experiment").glob("*.yaml"))


def experiment_config(name: str, overrides: Sequence[str] = ()) -> Any:
    """Experiment preset `name` composed as a sweep would compose it, Hydra's own config (the sweep grid in
    ``hydra.sweeper.params``) included."""
    from hydra import compose, initialize_config_dir

    from kvbench.cli import CONF_DIR
    from kvbench.errors import KVBenchError

    if name not in experiments():
        raise KVBenchError(f"unknown experiment {name!r}; available: {', '.join(experiments())}")
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose("config", overrides=[f"experiment={name}", *overrides], return_hydra_config=True)


def results_root(source: str | os.PathLike[str]) -> Path:
    """The results directory of `source`: a directory as given, or an experiment preset's ``results_dir``."""
    from kvbench.errors import KVBenchError

    path = Path(source)
    if path.is_dir():
        return path
    if str(source) in experiments():
        return Path(experiment_config(str(source)).results_dir)
    raise KVBenchError(f"{source}: neither a results directory nor an experiment (experiments: "
                       f"{', '.join(experiments())})")


def load(source: str | os.PathLike[str]) -> "pd.DataFrame":
    """All records of an experiment preset (``load("adakv_fig4")``, read from its ``results_dir``) or of a
    results directory, one row per record with the point's config flattened into columns (see `collect`)."""
    return collect(results_root(source))
