"""MInference's sparse prefill (`engine.prefill_attention=minference`): the authors' vertical and slash estimate, the
keys their kernel attends (against its index conversion transcribed), the masked attention, and the engine's
wiring (the prompt's first forward only, its own prefill snapshots, records, identity, settings checks)."""

from __future__ import annotations

import json
import random

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from kvbench.attention.minference import (
    BLOCK,
    MInference,
    block_coverage,
    estimate_vertical_slash,
    kernel_ranges,
    sparse_attention,
)
from kvbench.config.validate import check_prefill_attention
from kvbench.core.errors import KVBenchError
from kvbench.engine.config import EngineConfig
from kvbench.engine.sample import run_sample
from kvbench.engine.snapshots import PrefillSnapshots
from kvbench.methods import build_method
from kvbench.results.store import point_hash
from kvbench.run.identity import written_point_identity
from kvbench.tasks.synthetic import Synthetic


def _kernel_mask(offsets: list[int], columns: list[int], end: int, length: int) -> torch.Tensor:
    ranges, kept = kernel_ranges(offsets, columns, end)
    mask = torch.zeros(length, dtype=torch.bool)
    for start, stop in ranges:
        mask[max(start, 0):min(stop, length)] = True
    mask[[c for c in kept if c < length]] = True
    return mask


def test_block_coverage_is_the_kernels_index_conversion_on_every_key_a_block_can_see():
    """Random diagonal sets (scattered, in runs, with and without the 100 nearest, a single far one) and
    columns: for every query block, the keys before its end that `block_coverage` gives are those of the
    transcribed `convert_vertical_slash_indexes` loop: its clamped first range, its ranges grown by 64-key
    steps (wider than their diagonals' union), its columns up to the last range's end."""
    rng = random.Random(0)
    for _ in range(150):
        length = rng.randint(1, 600)
        offsets = set(range(min(length, 100))) if rng.random() < 0.5 else {rng.randrange(length)}
        target, runs = rng.randint(1, length), rng.random() < 0.5
        while len(offsets) < target:
            base = rng.randrange(length)
            offsets.update(range(base, min(length, base + rng.randint(1, 150))) if runs else [base])
        offsets = sorted(offsets, reverse=True)
        columns = sorted(rng.sample(range(length), rng.randint(0, length)))
        ends = torch.arange(1, -(-length // BLOCK) + 1) * BLOCK
        covered = block_coverage(torch.tensor(offsets), torch.tensor(columns, dtype=torch.long), ends, length)
        for row, end in enumerate(ends.tolist()):
            want = _kernel_mask(offsets, columns, end, length)
            assert torch.equal(covered[row, :end], want[:end]), (length, end)
    # a merged range covers more than its diagonals: offsets 130 and 70 of the block ending at 256 are bands
    # [62, 126) and [122, 186); the kernel's range grows from [62, 126) by 64 to [62, 190)
    assert kernel_ranges([130, 70, 0], [], 256)[0] == [(62, 190), (192, 256)]
    assert block_coverage(torch.tensor([130, 70, 0]), torch.tensor([], dtype=torch.long), torch.tensor([256]),
                          256)[0].nonzero().flatten().tolist() == [*range(62, 190), *range(192, 256)]


def test_the_estimate_keeps_the_first_keys_and_nearest_diagonals_and_the_heaviest_others():
    gen = torch.Generator().manual_seed(0)
    length, dim = 300, 16
    keys = torch.randn(length, dim, generator=gen)
    q = torch.randn(64, dim, generator=gen)
    keys[200] = q.mean(0) * 8  # a key every late query attends to: a vertical line
    columns, offsets = estimate_vertical_slash(q, keys, 0.25, 31, 101)
    assert columns.tolist() == sorted(columns.tolist()) and set(range(30)) <= set(columns.tolist())
    assert 200 in columns.tolist() and len(columns) == 31
    assert offsets.tolist() == sorted(offsets.tolist(), reverse=True) and set(range(100)) <= set(offsets.tolist())
    assert len(offsets) == 101 and int(offsets.max()) < length


def test_with_every_key_and_diagonal_it_is_causal_attention_and_with_fewer_it_is_not():
    gen = torch.Generator().manual_seed(1)
    length, dim = 200, 8
    q, k, v = (torch.randn(length, dim, generator=gen) for _ in range(3))
    dense = F.scaled_dot_product_attention(q[None], k[None], v[None], scale=0.3, is_causal=True)[0]
    columns, offsets = estimate_vertical_slash(q[-64:], k, 0.3, length, length)
    assert torch.allclose(sparse_attention(q, k, v, 0.3, columns, offsets), dense, atol=1e-5)
    columns, offsets = estimate_vertical_slash(q[-64:], k, 0.3, 30, 100)
    sparse = sparse_attention(q, k, v, 0.3, columns, offsets)
    assert torch.allclose(sparse[:100], dense[:100], atol=1e-5)  # rows 0-99 see only their 100 nearest diagonals
    assert not torch.allclose(sparse[150:], dense[150:], atol=1e-3)


def test_sizes_default_ratio_clamps_and_a_pattern_file(tmp_path):
    prefill = MInference()
    assert prefill.head_sizes(0, 5, 100_000) == (1000, 6096)
    assert prefill.head_sizes(0, 5, 2000) == (1000, 2000)
    assert MInference(ratio=0.01).head_sizes(0, 0, 100_000) == (30, 60)  # clamped up to 30 and 50 (60 here)
    file = tmp_path / "patterns.json"
    file.write_text(json.dumps([{"0": ["vertical_and_slash", 100, 800, 0.9]}, {}]))
    searched = MInference.from_settings({"pattern_file": str(file), "ratio": 0.5})
    assert searched.head_sizes(0, 0, 10_000) == (50, 400)
    assert searched.head_sizes(0, 1, 10_000) == (500, 3048)  # a head the file leaves out: the default
    assert searched.head_sizes(5, 0, 10_000) == (500, 3048)  # a layer past the file's too
    file.write_text(json.dumps([{"0": ["stream_llm", 100, 800, 0.9]}]))
    with pytest.raises(KVBenchError, match="vertical_and_slash heads only"):
        MInference.from_settings({"pattern_file": str(file)})


@pytest.mark.parametrize("bad, message", [
    ({"prefill_attention": "flash"}, "prefill_attention must be one of dense, minference"),
    ({"prefill_attention": "minference", "minference": {"vertical_size": 0}}, "vertical_size must be an integer"),
    ({"prefill_attention": "minference", "minference": {"slash_size": 800, "ratio": 0.1}}, "at least 100"),
    ({"prefill_attention": "minference", "minference": {"ratio": -1}}, "ratio must be a positive"),
    ({"prefill_attention": "minference", "minference": {"window": 3}}, "unknown setting"),
    ({"prefill_attention": "minference", "minference": {"pattern_file": "/nonexistent.json"}}, "no such file"),
])
def test_bad_settings_are_refused_in_one_line(bad, message):
    with pytest.raises(KVBenchError, match=message):
        check_prefill_attention(OmegaConf.create(bad))


def _sample(lm, length: int):
    task = Synthetic(lengths=[length], max_new_tokens=4)
    task.max_positions = lm.max_positions
    sample = task.samples(None, seed=2)[0]
    sample.turns[0].answers.append("the answer is 42")  # a gold answer: the record's NLL reads the logits
    return sample


def test_a_point_prefills_sparsely_once_per_setting_and_decodes_with_any_method(tiny_llama, monkeypatch):
    """On a tiny model: covering sizes give the dense prefill's logits (within float32 rounding); small ones
    change them; the prompt's first forward alone is sparse (decode steps and appended chunks are not); a
    shared prefill snapshot is the sparse prefill's, not the dense one's."""
    sample = _sample(tiny_llama, 500)
    dense_engine = EngineConfig(reuse_prefill=False)
    covering = EngineConfig(reuse_prefill=False, prefill_attention="minference",
                            minference={"vertical_size": 10_000, "slash_size": 10_000})
    sparse = EngineConfig(reuse_prefill=False, prefill_attention="minference",
                          minference={"vertical_size": 30, "slash_size": 100})
    full = build_method("full")
    dense_run = run_sample(tiny_llama, full, 64, sample, dense_engine)
    covering_run = run_sample(tiny_llama, full, 64, sample, covering)
    assert covering_run["nll"] == pytest.approx(dense_run["nll"], rel=1e-4)
    calls = []
    real = MInference.__call__
    monkeypatch.setattr(MInference, "__call__", lambda self, layer, q, *rest: calls.append(q.shape[2]) or
                        real(self, layer, q, *rest))
    sparse_run = run_sample(tiny_llama, full, 64, sample, sparse)
    prompt = len(calls) and calls[0]
    assert calls == [prompt] * tiny_llama.model.config.num_hidden_layers and prompt > 400  # one forward, every layer
    assert sparse_run["nll"] != pytest.approx(dense_run["nll"], rel=1e-4)
    # a snapshot shared by the points of a group is keyed by the prefill attention
    snapshots = PrefillSnapshots(512)
    shared = EngineConfig(prefill_attention="minference", minference={"vertical_size": 30, "slash_size": 100})
    snap = run_sample(tiny_llama, build_method("snapkv", window=8), 64, sample, EngineConfig(), snapshots=snapshots)
    sparse_snap = run_sample(tiny_llama, build_method("snapkv", window=8), 64, sample, shared, snapshots=snapshots)
    alone = run_sample(tiny_llama, build_method("snapkv", window=8), 64, sample,
                       EngineConfig(reuse_prefill=False, prefill_attention="minference",
                                    minference={"vertical_size": 30, "slash_size": 100}))
    assert sparse_snap["nll"] == alone["nll"] and sparse_snap["nll"] != snap["nll"]


def test_identity_and_records_name_the_sparse_prefill_only_when_it_runs(tmp_path):
    base = {"model": {"name": "smollm2_135m", "dtype": "float32", "device": "cpu"},
            "task": {"name": "ruler_niah_single_1", "seq_len": 1024}, "method": {"name": "full"}, "budget": 64,
            "compress_question": True, "seed": 0, "results_dir": str(tmp_path),
            "engine": {"nll": True, "prefill_attention": "dense", "minference": {"vertical_size": 1000}}}
    before = dict(base, engine={"nll": True})  # a point from before the setting existed
    dense = written_point_identity(OmegaConf.create(base))
    assert point_hash(dense) == point_hash(written_point_identity(OmegaConf.create(before)))
    sparse = OmegaConf.create(base)
    sparse.engine.prefill_attention = "minference"
    identity = written_point_identity(sparse)
    assert identity["engine"]["prefill_attention"] == "minference" and point_hash(identity) != point_hash(dense)
    smaller = OmegaConf.create(base)
    smaller.engine.prefill_attention, smaller.engine.minference.vertical_size = "minference", 500
    assert point_hash(written_point_identity(smaller)) != point_hash(identity)
