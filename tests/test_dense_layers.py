"""`dense_layers` for every method: the named layers keep their whole cache and attend densely, the others
are compressed exactly as without the setting (tiny random 6-layer Llama)."""

from __future__ import annotations

import pytest
import torch
from conftest import random_ids

from kvbench.core.errors import KVBenchError
from kvbench.engine.session import Session
from kvbench.methods import METHODS, build_method

PROMPT = 300
NEW = 6
BUDGET = 48
# one of each way a method compresses: one-shot and observed eviction, block-wise eviction, page selection,
# two-stage, retrieval from host memory, cross-layer selection
CASES = {
    "snapkv": {"window": 8},
    "h2o": {},
    "keydiff": {"block_size": 32},
    "quest": {},
    "rocketkv": {"window": 8, "last_prompt_token_via_decode": False},
    "ctkvr": {"n_init": 8, "n_local": 16, "max_centroids": 64},
    "omnikv": {"filter_layers": [2, 4]},
    "magicpig": {"n_local": 16, "dense_layers": None},
    "shadowkv": {"local_chunks": 1, "outlier_chunks": 2},
}


def run(lm, name: str, **params) -> tuple[Session, list[torch.Tensor], list[set[int]]]:
    """Prefill + NEW greedy decode steps; also which layers the method's `select` was asked about per step."""
    method = build_method(name, **{**CASES.get(name, {}), **params})
    asked: list[set[int]] = []
    if method.selects:
        select = method.select

        def spy(layer, *args):
            asked[-1].add(layer.layer_idx)
            return select(layer, *args)

        method.select = spy
    session = Session(lm, method, BUDGET, sequence_length=PROMPT + NEW)
    outs = [session.prefill(random_ids(PROMPT, seed=7), compress=True)[0]]
    for _ in range(NEW):
        asked.append(set())
        outs.append(session.step(int(outs[-1].argmax())))
    return session, outs, asked


@pytest.mark.parametrize("name", sorted(CASES))
def test_dense_first_layers_keep_everything_and_the_rest_compress_as_without(tiny_llama_deep, name):
    _, _, asked_plain = run(tiny_llama_deep, name)
    session, outs, asked = run(tiny_llama_deep, name, dense_layers=2)
    stored = PROMPT + NEW
    for layer in session.cache.layers[:2]:
        assert layer.lengths() == [stored] * layer.num_heads, f"layer {layer.layer_idx} lost tokens"
        assert not layer.derived, "a dense layer builds no selection state"
    compressed = [min(layer.lengths()) < stored or layer.derived for layer in session.cache.layers[2:]]
    assert any(compressed) or any(asked), f"{name} compressed nothing outside the dense layers"
    if session.method.selects:
        assert all(step.isdisjoint({0, 1}) for step in asked), "select was asked about a dense layer"
        assert all(step_plain - {0, 1} == step for step_plain, step in zip(asked_plain, asked))
    assert all(torch.isfinite(o).all() for o in outs)


@pytest.mark.parametrize("name", sorted(set(CASES) - {"omnikv"}))  # OmniKV's filter layers cannot be dense
def test_every_layer_dense_is_bitwise_full(tiny_llama_deep, name):
    layers = tiny_llama_deep.model.config.num_hidden_layers
    full = run(tiny_llama_deep, "full")[1]
    # one dense prefill like full's (a block-wise prefill rounds differently, whatever it keeps)
    one_shot = {"block_size": None} if "block_size" in CASES[name] else {}
    session, outs, asked = run(tiny_llama_deep, name, dense_layers=layers, **one_shot)
    assert all(torch.equal(a, b) for a, b in zip(outs, full))
    assert session.cache.evictions() == 0 and not any(asked)


def test_dense_layers_as_a_list_names_layers_and_bad_values_are_refused(tiny_llama_deep):
    session = run(tiny_llama_deep, "snapkv", dense_layers=[0, 3])[0]
    whole = [i for i, layer in enumerate(session.cache.layers) if min(layer.lengths()) == PROMPT + NEW]
    assert whole == [0, 3]
    for bad in (-1, 1.5, "2", [0, -2], True):
        with pytest.raises(KVBenchError, match="dense_layers"):
            build_method("snapkv", dense_layers=bad)
    with pytest.raises(KVBenchError, match="filter layer"):
        build_method("omnikv", filter_layers=[1, 3], dense_layers=2)


def test_rocketkv_skip_layers_is_dense_layers():
    skip = build_method("rocketkv", skip_layers=2)
    dense = build_method("rocketkv", dense_layers=2)
    assert [skip.is_dense_layer(i) for i in range(4)] == [dense.is_dense_layer(i) for i in range(4)] == [True, True, False, False]


def test_every_method_accepts_dense_layers():
    for name in METHODS:
        assert build_method(name, dense_layers=[0]).is_dense_layer(0)
