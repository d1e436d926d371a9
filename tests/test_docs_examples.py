"""The worked examples of docs/adding-a-method.md run as written and evict exactly what they claim."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from conftest import random_ids
from reference import reference_chunks
from test_eviction_family import run_and_record

from kvbench.engine.session import Session
from kvbench.methods import METHODS, build_method

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "adding-a-method.md"
PRELUDE = ("from dataclasses import dataclass\nimport torch\n"
           "from kvbench.methods.base import EvictionMethod, Method, keep_top, register_method\n")


def shipped(block: str) -> Path | None:
    """The file a block shows whole (its first line names it), if the package has it: it is compared, not run."""
    path = ROOT / block.splitlines()[0].removeprefix("# ")
    return path if block.startswith("# kvbench/") and path.is_file() else None


@pytest.fixture(scope="module")
def doc_methods():
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    namespace: dict = {}
    exec(PRELUDE, namespace)
    before = set(METHODS)
    for block in blocks:
        if shipped(block):
            continue
        if block.startswith("    def "):  # a method body shown alone: wrap it in a class
            block = "class Snippet:\n" + block
        exec(block, namespace)
    added = sorted(set(METHODS) - before)
    yield added, namespace
    for name in added:
        del METHODS[name]


def test_eviction_examples_match_the_dense_reference_one_shot_and_block_wise(tiny_llama, doc_methods):
    added, _ = doc_methods
    assert {"recent", "last_query", "peak_attention"} <= set(added)
    ids = random_ids(200, seed=40)
    for name in ("recent", "last_query", "peak_attention"):
        for schedule in ({}, {"block_size": 32}):
            session, chunks, past, outs = run_and_record(tiny_llama, build_method(name, **schedule), 40, ids, steps=4)
            assert session.cache.evictions() > 0
            for ours, theirs in zip(outs, reference_chunks(tiny_llama.model, chunks, past)):
                torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-5)


def test_selection_and_layer_budget_examples(tiny_llama, doc_methods):
    _, namespace = doc_methods
    session = Session(tiny_llama, build_method("topk_example"), 16)
    session.prefill(random_ids(100, seed=41), compress=True)
    assert torch.isfinite(session.step(5)).all()

    class Layer:
        pass

    layer, step, budgets = Layer(), Layer(), []
    step.num_layers = 6
    for layer.layer_idx in range(6):
        budgets.append(namespace["Snippet"]().layer_budget(layer, 100, step))
    assert sum(budgets) == 600


def test_a_shipped_method_the_page_shows_is_the_file_as_it_is():
    blocks = [b for b in re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S) if shipped(b)]
    assert [shipped(b).name for b in blocks] == ["random.py"]
    for block in blocks:
        assert block.split("\n", 1)[1] == shipped(block).read_text()
