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
import fcntl
import hashlib
import json
import logging
import math
import os
import socket
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


RECORDS_FILE = "records.jsonl"
MEASUREMENTS_FILE = "measurements.jsonl"  # `kvbench analyze`'s per-sample records (not points: reports skip them)
VERDICT_FILE = "verdict.json"  # `kvbench analyze`'s verdict of a claim, beside its measurements


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

    def __init__(self, run_dir: Path, filename: str = RECORDS_FILE) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / filename
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

    def recorded_digests(self) -> dict[str, str | None]:
        """Each recorded sample id and the digest of the sample it was computed on (None: a record from before
        records carried one)."""
        return {rec["sample_id"]: rec.get("sample_digest") for rec in self.records()}


def _atomic_write_json(path: Path, obj: Any) -> None:
    """Write JSON via a temp file and rename, so a kill never leaves a half-written manifest or summary."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(to_jsonable(obj), f, indent=2, sort_keys=True, allow_nan=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
