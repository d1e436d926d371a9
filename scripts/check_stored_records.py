"""Stored-records regression check: the current code must reproduce, exactly, the records that the reference
commit (`REFERENCE_COMMIT`) produces on the same kind of CPU.

    python scripts/check_stored_records.py                        # run the sweep into a temporary dir, compare
    python scripts/check_stored_records.py --results-dir DIR      # run it into DIR (must be new or empty), keep DIR
    python scripts/check_stored_records.py --existing-results DIR # compare a sweep already run (no new run)
    python scripts/check_stored_records.py --make-reference FILE  # the reference commit's records on this CPU

The sweep (from the repository root, HF_HUB_OFFLINE=1) is

    python -m kvbench -m method=full,streamingllm,snapkv,adakv,h2o,tova,keydiff,exact_topk,rocketkv,ctkvr,omnikv \\
        budget=96 task=custom task.path=tests/data/stored_records/niah_single_2_x3.jsonl model.dtype=float32 \\
        results_dir=DIR

on three RULER niah_single_2 samples (1,100-1,106 prompt tokens, embedded SmolLM2-135M in float32, CPU).
`extract` reduces each point directory's records.jsonl to the compared fields; `compare` checks them exactly:
the same point directories (their names carry the point hash), the same sample ids, the same values (floats
with ==, ints and floats not interchangeable). Any difference is printed as `point dir | sample | field: expected
X, got Y` and the exit status is 1 (2: the sweep itself failed).

The reference. Float32 products are bitwise reproducible on one kind of CPU, not across kinds: BLAS and ATen
pick their kernels (and so their summation orders) by the processor, and one commit gives nll values that differ
in the 7th digit on two kinds of Xeon (tests/data/stored_records/README.md). So the reference is "what the
reference commit gives on this kind of CPU": the stored files `expected*.json` (each its records on one kind of
CPU) are tried first, and where none matches exactly and git has the commit, it is built from git (`git
archive`, installed into a temporary directory) and its sweep is run here as the reference (a few minutes on 2
cores). The current code passes only if it equals one of them exactly.

The stored files are references, not snapshots to refresh: never regenerate them from the current code to make
a change pass (see tests/data/stored_records/README.md). `--make-reference` runs the reference commit, never the
code under test. The reference commit moves only with a deliberate change of the records, said in its commit and
in the README beside the files (d6b26fe until the batch-invariant decode padded a lone float32 row's products).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data" / "stored_records"
EXPECTED = DATA / "expected.json"  # the first kind of CPU; others are expected-*.json
REFERENCE_COMMIT = "4a99324"  # the batch-invariant decode (see the README beside the files)
# Relative, as given on the command line: the point hash includes task.path as written, so the sweep runs from
# the repository root with exactly this string.
SAMPLES = "tests/data/stored_records/niah_single_2_x3.jsonl"
SAMPLES_SHA256 = "57cda6e708544fbfdf6fdad822fd0c2231858f8c197c1173cd4ed49e86f53c42"
METHODS = ("full", "streamingllm", "snapkv", "adakv", "h2o", "tova", "keydiff", "exact_topk", "rocketkv", "ctkvr",
           "omnikv")
OVERRIDES = (f"method={','.join(METHODS)}", "budget=96", "task=custom", f"task.path={SAMPLES}",
             "model.dtype=float32")

# Compared fields of a record (top level) and of each of its turns.
RECORD_FIELDS = ("score", "nll", "kept_tokens_per_head", "kept_tokens_end_mean", "kv_bytes_after_compress",
                 "kv_bytes_after_prefill", "kv_bytes_end", "kv_peak_bytes", "new_tokens",
                 "decode_read_bytes_per_step", "storage_ratio_bytes", "topk_recall", "budget_plan")
TURN_FIELDS = ("prediction", "nll")


def sweep_command(results_dir: Path | str) -> list[str]:
    return [sys.executable, "-m", "kvbench", "-m", *OVERRIDES, f"results_dir={results_dir}"]


def check_samples_file(repo: Path = REPO) -> None:
    """The stored samples are part of the reference: refuse to run on an edited copy."""
    digest = hashlib.sha256((repo / SAMPLES).read_bytes()).hexdigest()
    if digest != SAMPLES_SHA256:
        raise RuntimeError(f"{SAMPLES} was modified (sha256 {digest}, stored records were made from "
                           f"{SAMPLES_SHA256}); restore it from git")


def run_sweep(results_dir: Path, repo: Path = REPO, timeout: float = 3600) -> float:
    """Run the sweep into `results_dir` (must not hold records: kvbench would resume them); returns seconds."""
    check_samples_file(repo)
    results_dir = Path(results_dir).resolve()
    if results_dir.exists() and any(results_dir.iterdir()):
        raise RuntimeError(f"{results_dir} is not empty; the sweep needs a fresh results directory")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    proc = subprocess.run(sweep_command(results_dir), cwd=repo, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"the sweep failed (exit {proc.returncode}):\n{proc.stdout[-6000:]}")
    return elapsed


def extract(results_dir: Path) -> dict[str, dict[str, dict[str, Any]]]:
    """{point dir relative to results_dir: {sample_id: compared fields}}; a field a record lacks is left out."""
    results_dir = Path(results_dir)
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for records in sorted(results_dir.rglob("records.jsonl")):
        point = records.parent.relative_to(results_dir).as_posix()
        samples: dict[str, dict[str, Any]] = {}
        for n, line in enumerate(records.read_text().splitlines(), 1):
            if not line.strip():
                continue
            record = json.loads(line)
            sample_id = str(record.get("sample_id"))
            if sample_id in samples:
                raise RuntimeError(f"{records}:{n}: sample {sample_id} recorded twice")
            fields = {key: record[key] for key in RECORD_FIELDS if key in record}
            if "turns" in record:
                fields["turns"] = [{key: turn[key] for key in TURN_FIELDS if key in turn} for turn in record["turns"]]
            samples[sample_id] = fields
        out[point] = samples
    return out


def _short(value: Any, limit: int = 300) -> str:
    text = json.dumps(value, sort_keys=True) if not isinstance(value, float) else repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


def _same(a: Any, b: Any) -> bool:
    """Exact equality for JSON values: types must match (1 != 1.0, True != 1), floats with == (NaN equals NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _diff_value(where: str, expected: Any, got: Any, out: list[str]) -> None:
    """The differences between two JSON values, at the deepest place where they differ."""
    if isinstance(expected, dict) and isinstance(got, dict):
        for key in sorted(expected.keys() | got.keys()):
            sub = f"{where}.{key}"
            if key not in got:
                out.append(f"{sub}: expected {_short(expected[key])}, got <missing>")
            elif key not in expected:
                out.append(f"{sub}: expected <missing>, got {_short(got[key])}")
            else:
                _diff_value(sub, expected[key], got[key], out)
    elif isinstance(expected, list) and isinstance(got, list) and len(expected) == len(got):
        for i, (x, y) in enumerate(zip(expected, got)):
            _diff_value(f"{where}[{i}]", x, y, out)
    elif not _same(expected, got):
        note = ""
        if type(expected) is not type(got):
            note = f" (type {type(expected).__name__} -> {type(got).__name__})"
        elif isinstance(expected, list):
            note = f" (length {len(expected)} -> {len(got)})"
        out.append(f"{where}: expected {_short(expected)}, got {_short(got)}{note}")


def compare(expected: dict, got: dict) -> list[str]:
    """One line per difference: `point dir | sample | field: expected X, got Y`; empty when identical."""
    diffs: list[str] = []
    for point in sorted(expected.keys() | got.keys()):
        if point not in got:
            diffs.append(f"{point}: point directory missing (expected {len(expected[point])} samples)")
            continue
        if point not in expected:
            diffs.append(f"{point}: unexpected point directory ({len(got[point])} samples)")
            continue
        exp_samples, got_samples = expected[point], got[point]
        for sample in sorted(exp_samples.keys() | got_samples.keys()):
            if sample not in got_samples:
                diffs.append(f"{point} | {sample}: sample missing")
            elif sample not in exp_samples:
                diffs.append(f"{point} | {sample}: unexpected sample")
            else:
                lines: list[str] = []
                _diff_value("", exp_samples[sample], got_samples[sample], lines)
                diffs.extend(f"{point} | {sample} | {line.lstrip('.')}" for line in lines)
    return diffs


def load_expected(path: Path = EXPECTED) -> dict:
    """A stored reference's extracted records."""
    return json.loads(Path(path).read_text())


def dump(extracted: dict, path: Path) -> None:
    """One compact JSON, sorted keys (how expected.json was written)."""
    Path(path).write_text(json.dumps(extracted, sort_keys=True, separators=(",", ":"), allow_nan=True) + "\n")


def stored_references() -> list[Path]:
    """The reference commit's records on each kind of CPU they were made on: expected.json first."""
    return [EXPECTED] + sorted(DATA.glob("expected-*.json"))


def reference_from_git(workdir: Path, repo: Path = REPO, timeout: float = 3600) -> dict:
    """The extracted records of the reference commit's own sweep run on this machine (the stored files'
    procedure): its tree from git, installed without dependencies into `workdir` and run from its root with only
    that copy importable (PYTHONSAFEPATH keeps the working directory off sys.path)."""
    source, site, results = workdir / "source", workdir / "site", workdir / "results"
    source.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(repo), "archive", "--format=tar", REFERENCE_COMMIT],
                             capture_output=True, timeout=120)
    if archive.returncode != 0:
        raise RuntimeError(f"git has no {REFERENCE_COMMIT} here (a shallow clone?): "
                           f"{archive.stderr.decode(errors='replace').strip()}")
    subprocess.run(["tar", "-x", "-C", str(source)], input=archive.stdout, check=True, timeout=120)
    install = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                              "--target", str(site), str(source)], capture_output=True, text=True, timeout=600)
    if install.returncode != 0:
        raise RuntimeError(f"installing {REFERENCE_COMMIT} failed:\n{install.stdout[-3000:]}{install.stderr[-3000:]}")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(site), "PYTHONSAFEPATH": "1"}
    proc = subprocess.run(sweep_command(results), cwd=source, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{REFERENCE_COMMIT}'s sweep failed (exit {proc.returncode}):\n{proc.stdout[-6000:]}")
    for manifest in results.rglob("manifest.json"):  # the installed copy ran, not the code under test
        ran = json.loads(manifest.read_text())["argv"][0]
        if not Path(ran).resolve().is_relative_to(site.resolve()):
            raise RuntimeError(f"{manifest}: the reference sweep ran {ran}, not the copy of {REFERENCE_COMMIT}")
    return extract(results)


def _shown(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def verify(got: dict, build_reference: bool = True) -> tuple[str, list[str]]:
    """(the reference compared against, the differences): the first stored reference `got` equals exactly, else
    the reference commit run here, else (git lacks it) the stored reference closest to `got`."""
    attempts = []
    for path in stored_references():
        diffs = compare(load_expected(path), got)
        if not diffs:
            return _shown(path), []
        attempts.append((len(diffs), _shown(path), diffs))
    if build_reference:
        print(f"no stored reference matches this CPU's records exactly; running {REFERENCE_COMMIT} here ...",
              flush=True)
        with tempfile.TemporaryDirectory(prefix="kvbench-reference-") as tmp:
            try:
                reference = reference_from_git(Path(tmp))
            except RuntimeError as exc:
                print(f"cannot run {REFERENCE_COMMIT} here: {exc}", flush=True)
            else:
                return f"{REFERENCE_COMMIT} run on this machine", compare(reference, got)
    _, name, diffs = min(attempts)
    return name, diffs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--results-dir", type=Path, help="run the sweep into this (new or empty) directory and keep it")
    where.add_argument("--existing-results", type=Path, help="compare the records of a sweep already run here")
    where.add_argument("--make-reference", type=Path,
                       help=f"write {REFERENCE_COMMIT}'s records on this CPU to this file (expected-<cpu>.json)")
    parser.add_argument("--dump", type=Path, help="also write the extracted fields of this run to this file")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds allowed for the sweep")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="kvbench-stored-records-") as tmp:
        if args.make_reference is not None:
            print(f"running {REFERENCE_COMMIT}'s sweep ...", flush=True)
            dump(reference_from_git(Path(tmp), timeout=args.timeout), args.make_reference)
            print(f"wrote {REFERENCE_COMMIT}'s records on this CPU to {args.make_reference}")
            return 0
        if args.existing_results is not None:
            results_dir = args.existing_results
        else:
            results_dir = args.results_dir if args.results_dir is not None else Path(tmp) / "results"
            print(f"running the sweep into {results_dir} (cwd {REPO}) ...", flush=True)
            try:
                elapsed = run_sweep(results_dir, timeout=args.timeout)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 2
            print(f"sweep finished in {elapsed:.0f} s", flush=True)
        got = extract(results_dir)
    if args.dump is not None:
        dump(got, args.dump)
        print(f"wrote the extracted fields to {args.dump}")
    reference, diffs = verify(got)
    n_samples = sum(len(samples) for samples in got.values())
    if diffs:
        print(f"FAIL: {len(diffs)} difference(s) from {reference}:")
        for line in diffs:
            print(f"  {line}")
        return 1
    print(f"OK: {len(got)} points, {n_samples} samples identical to {reference}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
