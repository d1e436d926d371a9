"""Squeezed Attention: cosine k-means over the prompt's keys but its window, centroids as the means of the raw
keys, the release's cluster estimate S_k = exp(s q.c_k) / sum_j n_j exp(s q.c_j), and each query head's budget
of keys from the clusters of highest S, plus the window and the generated tokens."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvbench.core.contract import Plan
from kvbench.engine.config import EngineConfig
from kvbench.engine.sample import run_sample
from kvbench.methods import build_method, squeezed_attention
from kvbench.methods.squeezed_attention import KeyClusters, SqueezedAttention, spherical_kmeans
from kvbench.tasks.synthetic import Synthetic


def test_kmeans_groups_keys_by_direction_not_length_and_is_seeded(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    directions = F.normalize(torch.randn(4, 16, generator=gen), dim=-1)
    truth = torch.arange(40) % 4
    # each key a direction times a length from 0.1 to 10: cosine k-means must ignore the length
    lengths = torch.logspace(-1, 1, 40)[torch.randperm(40, generator=gen)]
    keys = (directions[truth] + 0.01 * torch.randn(40, 16, generator=gen)) * lengths[:, None]
    keys = torch.stack([keys, keys.flip(0)])  # two heads
    labels, ran = spherical_kmeans(keys, 4, 300, torch.Generator().manual_seed(1))
    assert ran < 300  # stopped once no label changed
    for head, order in ((0, truth), (1, truth.flip(0))):
        pairs = set(zip(order.tolist(), labels[head].tolist()))
        assert len(pairs) == 4 and len({label for _, label in pairs}) == 4  # one label per true cluster
    again, _ = spherical_kmeans(keys, 4, 300, torch.Generator().manual_seed(1))
    assert torch.equal(again, labels)
    monkeypatch.setattr(squeezed_attention, "SIMILARITY_ELEMENTS", 2 * 4 * 3)  # 3 keys scored at a time
    chunked, _ = spherical_kmeans(keys, 4, 300, torch.Generator().manual_seed(1))
    assert torch.equal(chunked, labels)


def _layer_with(keys: torch.Tensor):
    """A stand-in for a layer after the prompt: `seen`, a uniform head view and the derived state."""
    class View:
        pass

    class Layer:
        derived: dict = {}
        is_ragged = False

        def head_view(self):
            view = View()
            view.keys = keys
            return view

    layer = Layer()
    layer.seen = keys.shape[1]
    layer.derived = {}
    return layer


class _Step:
    def __init__(self, budget: int, generator=None):
        self.plan = Plan(evict=budget, select=budget)
        self.generator = generator or torch.Generator().manual_seed(0)


def test_the_estimate_is_the_exact_softmax_when_every_key_is_its_centroid_and_whole_clusters_are_chosen():
    gen = torch.Generator().manual_seed(2)
    heads, group, dim = 2, 3, 8
    centres = torch.randn(heads, 5, dim, generator=gen) * 2
    sizes = torch.tensor([[4, 6, 2, 5, 3], [3, 3, 3, 3, 8]])
    labels = torch.stack([torch.repeat_interleave(torch.arange(5), sizes[h]) for h in range(heads)])
    labels = torch.stack([row[torch.randperm(20, generator=gen)] for row in labels])  # clusters interleaved
    keys = centres.gather(1, labels[..., None].expand(-1, -1, dim))  # every key exactly its centroid
    window = torch.randn(heads, 4, dim, generator=gen)
    index = KeyClusters(centres, labels, sizes.float(), 1)
    layer = _layer_with(torch.cat([keys, window], dim=1))
    layer.derived["clusters"] = index
    q = torch.randn(heads, group, dim, generator=gen)
    method = SqueezedAttention(window=4)
    for budget in (1, 6, 11, 19):
        selection = method.select(layer, q, layer.head_view(), _Step(budget), 0.5)
        idx = selection.idx
        assert idx.shape == (heads, group, budget + 4)
        assert torch.equal(idx[..., budget:], torch.arange(20, 24).expand(heads, group, -1))  # the window, always
        exact = torch.softmax(torch.einsum("hgd,hnd->hgn", q, keys) * 0.5, dim=-1)  # over the clustered keys
        for h in range(heads):
            for g in range(group):
                chosen = idx[h, g, :budget]
                # the keys of highest exact probability (ties: whole clusters, the boundary one cut earliest)
                order = sorted(range(20), key=lambda t: (-round(float(exact[h, g, t]), 5), t))
                assert set(chosen.tolist()) == set(order[:budget])
    assert method.select(layer, q, layer.head_view(), _Step(20), 0.5) is None  # the budget covers every key


def test_keep_clusters_the_prompt_but_its_window_and_keeps_every_row():
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(2, 130, 8, generator=gen)
    layer = _layer_with(keys)
    method = SqueezedAttention(window=30, percent_clusters=10)
    assert method.keep(layer, 16, _Step(16)) is None  # nothing evicted
    index = layer.derived["clusters"]
    assert index.clustered == 100 and index.centroids.shape == (2, 10, 8)
    assert torch.equal(index.sizes.sum(-1), torch.full((2,), 100.0))
    for h in range(2):  # each centroid is the mean of its raw keys
        for c in range(10):
            members = keys[h, :100][index.labels[h] == c]
            if len(members):
                assert torch.allclose(index.centroids[h, c], members.mean(0), atol=1e-6)
    big = _layer_with(keys)
    assert method.keep(big, 100, _Step(100)) is None and "clusters" not in big.derived  # budget >= clustered


def test_settings_are_checked():
    for bad in ({"percent_clusters": 0}, {"percent_clusters": 101}, {"window": -1}, {"kmeans_iterations": 0}):
        with pytest.raises(Exception, match=next(iter(bad))):
            build_method("squeezed_attention", **bad)


def test_on_a_tiny_model_a_covering_budget_is_full_attention_and_runs_repeat(tiny_llama):
    task = Synthetic(lengths=[400], max_new_tokens=6)
    task.max_positions = tiny_llama.max_positions
    sample = task.samples(None, seed=1)[0]
    engine = EngineConfig(reuse_prefill=False)
    full = run_sample(tiny_llama, build_method("full"), 64, sample, engine)
    covering = run_sample(tiny_llama, build_method("squeezed_attention", window=16), 390, sample, engine)
    assert covering["turns"][0]["prediction"] == full["turns"][0]["prediction"]
    assert covering["nll"] == full["nll"]
    sparse = [run_sample(tiny_llama, build_method("squeezed_attention", window=16), 32, sample, engine)
              for _ in range(2)]
    assert sparse[0]["turns"][0]["prediction"] == sparse[1]["turns"][0]["prediction"]
    assert sparse[0]["nll"] == sparse[1]["nll"]
    plan = sparse[0]["budget_plan"]
    assert plan["window"] == 16 and plan["centroids"] == int(0.05 * plan["clustered"])
    # each query head attends to the budget, the window and the tokens generated so far
    assert 32 + 16 <= sparse[0]["decode_attended_tokens_per_head"] <= 32 + 16 + 6
