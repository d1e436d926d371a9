"""MagicPIG: SimHash sampling probability, unbiased importance-sampled attention, host placement (tiny models)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import random_ids

from kvbench.engine.config import EngineConfig
from kvbench.engine.sample import run_sample
from kvbench.engine.session import Session
from kvbench.methods import build_method
from kvbench.methods.magicpig import LSHSegment, collision_counts, sampling_probability, simhash, simhash_planes
from kvbench.tasks.base import Sample, Turn

PROMPT = 400
SMALL = {"n_sink": 4, "n_local": 32, "dense_layers": None}


def decode(session: Session, logits: torch.Tensor, steps: int) -> list[torch.Tensor]:
    outs = [logits]
    for _ in range(steps):
        outs.append(session.step(int(outs[-1].argmax())))
    return outs


def run(lm, budget: int, steps: int = 6, ids_seed: int = 80, **params) -> tuple[Session, list[torch.Tensor]]:
    session = Session(lm, build_method("magicpig", **{**SMALL, **params}), budget, sequence_length=PROMPT + steps)
    return session, decode(session, session.prefill(random_ids(PROMPT, seed=ids_seed), compress=True)[0], steps)


def draws(dim: int, bits: int, tables: int, n: int, seed: int = 1) -> torch.Tensor:
    """n independent sets of SimHash hyperplanes [n, D, K*L]."""
    return torch.randn((n, dim, bits * tables), generator=torch.Generator().manual_seed(seed))


def problem(n: int = 48, dim: int = 16, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, keys, values = torch.randn(dim, generator=gen), torch.randn(n, dim, generator=gen), torch.randn(n, dim, generator=gen)
    cos = keys @ q / (keys.norm(dim=-1) * q.norm())
    return q, keys, values, cos, 0.5 * keys @ q  # logits s_i


def sampled_over_draws(q, keys, planes, tables) -> torch.Tensor:
    """[N, n] bool: key i sampled in draw d (>= 2 table collisions with the query)."""
    counts = collision_counts(simhash(q, planes, tables)[:, None, :], simhash(keys, planes, tables), chunk=1024)
    return counts[:, 0] >= 2


def test_sampling_probability_matches_the_collision_frequency_over_hash_draws():
    bits, tables, n_draws = 3, 6, 4000
    q, keys, _, cos, _ = problem()
    planes = draws(16, bits, tables, n_draws)
    q_codes, k_codes = simhash(q, planes, tables), simhash(keys, planes, tables)  # [N, L], [N, n, L]
    # one table: the K sign bits agree with probability (1 - theta/pi)^K
    per_table = (q_codes[:, None, :] == k_codes).float().mean(dim=(0, 2))
    p = (1 - torch.arccos(cos.double()) / math.pi) ** bits
    sd = (p * (1 - p) / (n_draws * tables)).sqrt()
    assert ((per_table.double() - p).abs() <= 4.5 * sd + 1e-9).all()
    # the collision rule: sampled iff >= 2 of L tables collide, with probability u = P(Bin(L, p) >= 2)
    freq = sampled_over_draws(q, keys, planes, tables).double().mean(dim=0)
    u = sampling_probability(cos, bits, tables)
    assert torch.allclose(u, 1 - (1 - p) ** tables - tables * p * (1 - p) ** (tables - 1), atol=1e-12)
    assert ((freq - u).abs() <= 4.5 * (u * (1 - u) / n_draws).sqrt() + 1e-9).all()
    assert float(u.min()) < 0.05 and float(u.max()) > 0.5  # the keys span a range of probabilities


def test_horvitz_thompson_sums_are_unbiased_over_hash_draws():
    bits, tables, n_draws = 4, 16, 3000
    q, keys, values, cos, logits = problem()
    sampled = sampled_over_draws(q, keys, draws(16, bits, tables, n_draws, seed=2), tables).float()
    weights = sampled * (logits.exp() / sampling_probability(cos, bits, tables).float())  # e^{s_i} / u_i on S
    den, num = weights.sum(-1), weights @ values  # [N], [N, D]
    exact_den, exact_num = logits.exp().sum(), logits.exp() @ values
    assert abs(float(den.mean() - exact_den)) <= 4 * float(den.std()) / math.sqrt(n_draws)
    assert ((num.mean(0) - exact_num).abs() <= 4 * num.std(0) / math.sqrt(n_draws)).all()
    # the self-normalised estimate over the pooled draws is exact attention up to the sampling error
    exact = exact_num / exact_den
    pooled = num.mean(0) / den.mean()
    assert float((pooled - exact).norm()) < 0.1 * float(exact.norm())


def test_self_normalised_output_converges_to_exact_attention_as_l_grows():
    q, keys, values, cos, logits = problem(seed=3)
    exact = torch.softmax(logits, -1) @ values
    errors = []
    for tables in (16, 64, 256):
        sampled = sampled_over_draws(q, keys, draws(16, 4, tables, 300, seed=4), tables).float()
        weights = sampled * (logits.exp() / sampling_probability(cos, 4, tables).float())
        out = (weights @ values) / weights.sum(-1, keepdim=True)
        errors.append(float(((out - exact) ** 2).sum(-1).mean()))
    assert errors[0] > 10 * errors[1] > 100 * errors[2], errors


def test_a_step_samples_by_the_collision_rule_and_weights_rows_by_minus_log_u(tiny_llama):
    """Each query head's finite log-weights are exactly the host rows with >= 2 table collisions (recomputed
    from the sign bits of the centred keys), valued -log u from the angle; the external rows are host rows."""
    bits, tables = 5, 24
    session, _ = run(tiny_llama, 64, steps=0, K=bits, L=tables, weight_eps=0.0)
    layer = session.cache.layers[1]
    host = layer.derived["host"]
    q = torch.randn(layer.num_heads, 2, layer.head_dim, generator=torch.Generator().manual_seed(5))
    selection = session.method.select(layer, q, layer.head_view(), session.step_context(), layer.scaling)
    keys, values, valid, log_weights = selection.external
    centred = host.keys - host.keys.mean(dim=1, keepdim=True)
    planes = simhash_planes(layer.head_dim, bits, tables, 0)
    k_bits = (centred @ planes > 0).unflatten(-1, (tables, bits))  # [H, M, L, K]
    q_bits = (q @ planes > 0).unflatten(-1, (tables, bits))  # [H, G, L, K]
    collisions = (q_bits[:, :, None] == k_bits[:, None]).all(-1).sum(-1)  # [H, G, M]
    for h in range(layer.num_heads):
        rows = [int((host.keys[h] == keys[h, j]).all(-1).nonzero()[0]) for j in range(keys.shape[1]) if valid[h, j]]
        assert rows == sorted(rows) and torch.equal(values[h, valid[h]], host.values[h, rows])
        for g in range(2):
            picked = [r for r, lw in zip(rows, log_weights[h, g, valid[h]]) if torch.isfinite(lw)]
            assert picked == (collisions[h, g] >= 2).nonzero().flatten().tolist()
            cos = torch.nn.functional.cosine_similarity(q[h, g][None], centred[h, picked], dim=-1).double()
            p = (1 - torch.arccos(cos) / math.pi) ** bits
            u = 1 - (1 - p) ** tables - tables * p * (1 - p) ** (tables - 1)
            finite = log_weights[h, g, valid[h]][torch.isfinite(log_weights[h, g, valid[h]])]
            torch.testing.assert_close(finite.double(), -u.log(), atol=1e-4, rtol=1e-4)
    assert selection.extra["sampled_per_head"] == pytest.approx(float((collisions >= 2).sum(-1).float().mean()))
    assert selection.extra["sampled_fraction"] == pytest.approx(selection.extra["sampled_per_head"] / host.keys.shape[1])


def test_every_key_sampled_with_probability_near_one_is_full_attention(tiny):
    """K = 2 bits, L = 400 tables: u ~ 1 for every key, so the merged estimate is exact attention."""
    ids = random_ids(PROMPT, seed=81)
    full = Session(tiny, build_method("full"), None)
    outs_full = decode(full, full.prefill(ids, compress=True)[0], 5)
    session, outs = run(tiny, 64, steps=5, ids_seed=81, K=2, L=400)
    stats = session.cache.stats.extra_sums
    assert stats["sampled_fraction"] / session.cache.stats.extra_steps == 1.0
    for ours, theirs in zip(outs, outs_full):
        torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("params", [{}, SMALL])
def test_budget_at_or_above_the_sequence_is_bitwise_full(tiny, params):
    ids = random_ids(PROMPT, seed=82)
    full = Session(tiny, build_method("full"), None)
    outs_full = decode(full, full.prefill(ids, compress=True)[0], 6)
    session = Session(tiny, build_method("magicpig", **params), PROMPT + 10, sequence_length=PROMPT + 10)
    outs = decode(session, session.prefill(ids, compress=True)[0], 6)
    assert all(torch.equal(a, b) for a, b in zip(outs, outs_full))
    assert session.cache.evictions() == 0 and not any(layer.derived for layer in session.cache.layers)


def test_resident_rows_are_sinks_local_and_generated_and_the_rest_is_on_the_host(tiny_llama):
    steps = 5
    session, outs = run(tiny_llama, 64, steps=steps, dense_layers=[0])
    dense, sparse = session.cache.layers
    assert dense.lengths() == [PROMPT + steps] * dense.num_heads and not dense.derived
    resident = set(range(4)) | set(range(PROMPT - 32, PROMPT + steps))
    assert all(set(p.tolist()) == resident for p in sparse.positions)
    host = sparse.derived["host"]
    assert isinstance(host, LSHSegment) and host.keys.device.type == "cpu"
    assert all(p.tolist() == list(range(4, PROMPT - 32)) for p in host.positions)
    assert host.codes.shape == (sparse.num_heads, PROMPT - 36, 120) and host.codes.dtype == torch.int16
    # one copy of every token, wherever it lives; the host side also holds the tables
    full = 2 * 2 * sparse.num_heads * sparse.head_dim * 4 * (PROMPT + steps)
    assert session.cache.kv_bytes() + 2 * host.keys.numel() * 4 == full
    tables = host.codes.numel() * 2 + host.norms.numel() * 4 + host.center.numel() * 4
    assert host.nbytes() == 2 * host.keys.numel() * 4 + host.positions.numel() * host.positions.element_size() + tables
    assert all(torch.isfinite(o).all() for o in outs)


def sample(question: str = "Which letter comes most often?") -> Sample:
    context = "".join(__import__("random").Random(3).choices("abcdefgh ", k=600))
    return Sample(id="s0", task="synthetic", context=context,
                  turns=[Turn(question, ["a"], max_new_tokens=8, metric="string_match_all")])


@pytest.mark.parametrize("compress_question", [True, False])
def test_greedy_decode_runs_and_records_dynamic_sparsity_and_host_bytes(tiny, compress_question):
    method = build_method("magicpig", n_local=32)  # layer 0 dense (the code's default), layer 1 sampled
    record = run_sample(tiny, method, 64, sample(), EngineConfig(compress_question=compress_question))
    assert record["new_tokens"] > 0 and record["compressed"] and record["nll"] is not None
    stats = record["decode_method_stats"]
    assert 0 < stats["sampled_fraction"] <= 1 and stats["sampled_per_head"] <= stats["sampled_per_group"]
    assert 0 < stats["attended_fraction"] <= 1
    assert record["host_bytes_end"] > 0 and record["device_bytes_end"] > 0
    assert record["storage_ratio_table1"] > 1  # every row kept (host or device) plus the codes
    assert record["decode_read_tokens_per_group"] > 0


def test_a_fixed_seed_repeats_exactly_and_another_seed_samples_differently(tiny_llama):
    outs = [run(tiny_llama, 64, ids_seed=83, **params)[1] for params in ({}, {}, {"seed": 1}, {"hash_chunk": 50})]
    assert all(torch.equal(a, b) for a, b in zip(outs[0], outs[1]))
    assert not all(torch.equal(a, b) for a, b in zip(outs[0], outs[2]))
    assert all(torch.equal(a, b) for a, b in zip(outs[0], outs[3]))  # hashing in chunks changes nothing
