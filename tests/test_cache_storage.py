"""The cache's row storage: appends write into slack in place (amortised O(1), no copy of the layer), clones
share buffers copy-on-write, a decode step's eviction rewrites rows in place only where no clone shares them,
and the bytes held and allocated are counted apart."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from conftest import random_ids

from kvbench.cache.dynamic import DynamicKVLayer
from kvbench.cache.layer import GROWTH, MIN_SLACK
from kvbench.engine.session import Session
from kvbench.methods import build_method
from kvbench.methods.duoattention import write_pattern

PROMPT = 96

# full: a uniform layer; adakv at 40 tokens per head: a ragged one (random heads get different budgets)
LAYOUTS = [("full", None, False), ("adakv", 40, True)]


def _compressed(lm, method: str, budget: int | None, seed: int = 3) -> tuple[Session, torch.Tensor]:
    session = Session(lm, build_method(method, window=8) if method == "adakv" else build_method(method), budget)
    logits, _ = session.prefill(random_ids(PROMPT, seed=seed), compress=True)
    return session, logits


@pytest.mark.parametrize("method,budget,ragged", LAYOUTS)
def test_reserved_decode_appends_in_place(tiny, method, budget, ragged):
    session, logits = _compressed(tiny, method, budget)
    assert any(layer.is_ragged for layer in session.cache.layers) == ragged
    before = session.cache.kept_per_head()
    session.cache.reserve(24)
    buffers = [{name: t.data_ptr() for name, t in layer.buffers.items()} for layer in session.cache.layers]
    relayouts = [layer.relayouts for layer in session.cache.layers]
    for _ in range(24):
        logits = session.step(int(logits.argmax()))
    for layer, ptrs, copies, lens in zip(session.cache.layers, buffers, relayouts, before):
        assert {name: t.data_ptr() for name, t in layer.buffers.items()} == ptrs  # the same storage
        assert layer.relayouts == copies
        assert layer.lengths() == [n + 24 for n in lens]
        assert layer.kv_capacity_nbytes() == layer.kv_nbytes()  # the reservation is used up exactly


@pytest.mark.parametrize("method,budget,ragged", LAYOUTS)
def test_unreserved_appends_copy_the_layer_a_logarithmic_number_of_times(tiny, method, budget, ragged):
    session, logits = _compressed(tiny, method, budget)
    starts = [layer.physical_length() for layer in session.cache.layers]
    steps = 400
    for _ in range(steps):
        logits = session.step(int(logits.argmax()))
    for layer, start in zip(session.cache.layers, starts):
        longest = layer.physical_length()
        assert longest == start + steps
        # each copy grows the slack by GROWTH of the longest head: about log_{1+GROWTH}(end / start) copies
        assert layer.relayouts <= math.log(longest / start) / math.log(1 + GROWTH) + MIN_SLACK // 4 + 2
        slack = max(MIN_SLACK, math.ceil(GROWTH * longest)) * layer.num_heads
        assert layer.kv_capacity_nbytes() <= layer.kv_nbytes() + 2 * slack * layer.head_dim * 4


@pytest.mark.parametrize("method,budget,ragged", LAYOUTS)
def test_clones_share_buffers_and_copy_on_write(tiny, method, budget, ragged):
    original, logits = _compressed(tiny, method, budget)
    original.cache.reserve(4)
    twin = original.fork()
    twin.position = original.position
    shared = original.cache.layers[0].buffers["keys"].data_ptr()
    assert twin.cache.layers[0].buffers["keys"].data_ptr() == shared
    a, b = int(logits.argmax()), int(logits.argsort()[-2])
    after_a = original.step(a)  # claims the slack in place
    after_b = twin.step(b)  # finds it claimed: copies before writing
    assert original.cache.layers[0].buffers["keys"].data_ptr() == shared
    assert twin.cache.layers[0].buffers["keys"].data_ptr() != shared
    for token, got, session in ((a, after_a, original), (b, after_b, twin)):
        fresh, _ = _compressed(tiny, method, budget)
        assert torch.equal(fresh.step(token), got)  # each saw its own token, not the other's
        for mine, theirs in zip(session.cache.layers, fresh.cache.layers):
            a_view, b_view = mine.head_view(), theirs.head_view()
            held = a_view.positions >= 0  # padding rows of a ragged view hold whatever the clamp read
            assert torch.equal(a_view.positions, b_view.positions)
            assert torch.equal(a_view.keys[held], b_view.keys[held])
            assert torch.equal(a_view.values[held], b_view.values[held])


def _sliding_window(lm, pattern: Path) -> tuple[Session, torch.Tensor]:
    """DuoAttention with one head of each layer streaming (sink 4 + recent 8): ragged layers cut every step."""
    write_pattern(torch.eye(lm.model.config.num_hidden_layers, lm.model.config.num_key_value_heads), pattern)
    method = build_method("duoattention", pattern=str(pattern), budget_rule="sparsity", sparsity=0.5, sink=4,
                          recent=8)
    session = Session(lm, method, 64)
    logits, _ = session.prefill(random_ids(PROMPT, seed=3), compress=True)
    return session, logits


def _held(session: Session) -> list[tuple[torch.Tensor, ...]]:
    views = [layer.head_view() for layer in session.cache.layers]
    return [(v.positions, v.keys[v.positions >= 0], v.values[v.positions >= 0]) for v in views]


def test_decode_evictions_rewrite_the_rows_in_place_as_the_copying_path_would(tiny, monkeypatch, tmp_path):
    session, logits = _sliding_window(tiny, tmp_path / "gates.tsv")
    untouched = _held(session)
    session.cache.reserve(16)  # the first append writes in place, into buffers the twin shares
    twin = session.fork()  # so the first eviction must copy, not rewrite them
    tokens, storage = [], None
    for step in range(12):
        tokens.append(int(logits.argmax()))
        logits = session.step(tokens[-1])
        layers = session.cache.layers
        if step == 1:  # after the copy that unshares and the append that re-lays out with slack
            storage = [(layer.buffers["keys"].data_ptr(), layer.relayouts) for layer in layers]
        elif step > 1:
            assert [(layer.buffers["keys"].data_ptr(), layer.relayouts) for layer in layers] == storage
    assert all(layer.is_ragged and layer.evictions >= 12 for layer in session.cache.layers)
    for mine, theirs in zip(_held(twin), untouched):  # the clone still holds what it was cloned with
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs))
    monkeypatch.setattr(DynamicKVLayer, "_rewritable", lambda self, kept: False)  # every eviction copies compactly
    reference, ref_logits = _sliding_window(tiny, tmp_path / "gates.tsv")
    for token in tokens:
        ref_logits = reference.step(token)
    assert torch.equal(logits, ref_logits)
    assert session.cache.kv_bytes() == reference.cache.kv_bytes()
    for mine, theirs in zip(_held(session), _held(reference)):
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs))


def test_token_state_travels_with_rows_through_appends_and_eviction(tiny):
    session, logits = _compressed(tiny, "adakv", 40)
    layer = session.cache.layers[0]
    marks = torch.arange(sum(layer.lengths()), dtype=torch.float32)
    layer.token_state["mark"] = marks  # ragged: flat, head after head
    assert torch.equal(layer.token_state["mark"], marks)
    logits = session.step(int(logits.argmax()))  # no room: a copy with slack, the new token's state is 0
    lens = layer.lengths()
    expected = torch.cat([torch.cat([part, torch.zeros(1)]) for part in marks.split([n - 1 for n in lens])])
    assert torch.equal(layer.token_state["mark"], expected)
    layer.retain([torch.tensor([0, n - 1]) for n in lens])  # the first and the newest row of each head
    assert layer.lengths() == [2] * len(lens) and not layer.is_ragged
    assert torch.equal(layer.token_state["mark"], expected.view(-1)[
        torch.tensor([[s, s + n - 1] for s, n in zip([0, *torch.tensor(lens).cumsum(0)[:-1].tolist()], lens)])])
