"""Stored-records regression: the sweep of scripts/check_stored_records.py must reproduce
tests/data/stored_records/expected.json (records of commit d6b26fe) exactly. About 3-4 minutes on 2 CPU cores."""

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
    diffs = check.compare(check.load_expected(), check.extract(results))
    assert not diffs, f"{len(diffs)} difference(s) from the stored records:\n" + "\n".join(diffs)
