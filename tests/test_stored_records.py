"""Stored-records regression: the sweep of scripts/check_stored_records.py must reproduce, exactly, the records
the reference commit gives on this kind of CPU (tests/data/stored_records/expected*.json, or that commit run here
when no stored file is of this kind). About 2-4 minutes on 2 CPU cores."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "check_stored_records.py"


def load_check():
    spec = importlib.util.spec_from_file_location("check_stored_records", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(3600)
def test_sweep_reproduces_the_stored_records(tmp_path):
    check = load_check()
    results = tmp_path / "results"
    check.run_sweep(results)
    reference, diffs = check.verify(check.extract(results))
    assert not diffs, f"{len(diffs)} difference(s) from {reference}:\n" + "\n".join(diffs)


def test_records_of_no_stored_kind_of_cpu_are_compared_with_the_closest_stored_reference(tmp_path, monkeypatch):
    check = load_check()
    stored = check.load_expected()
    point = sorted(stored)[0]
    sample = sorted(stored[point])[0]
    other = tmp_path / "expected-other.json"
    other.write_text(check.json.dumps({"nowhere": {}}))
    monkeypatch.setattr(check, "stored_references", lambda: [check.EXPECTED, other])
    got = check.json.loads(check.json.dumps(stored))
    got[point][sample]["nll"] += 1e-9
    reference, diffs = check.verify(got, build_reference=False)
    assert reference.endswith("expected.json")
    assert diffs == [f"{point} | {sample} | nll: expected {stored[point][sample]['nll']!r}, "
                     f"got {got[point][sample]['nll']!r}"]
    assert check.verify(stored, build_reference=False) == ("tests/data/stored_records/expected.json", [])
