"""DuoAttention: retrieval heads keep everything, streaming heads sink + recent (sliding while decoding), heads
ranked by a gate pattern, RocketKV's budget rule, and the gate calibration (tiny random models, seconds)."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
import torch
from conftest import CONF, random_ids

from kvbench.calibration.duoattention import (
    _ACTIVE,
    CalibrationSettings,
    GateState,
    calibrate,
    gated_attention,
    passkey_sample,
    save,
)
from kvbench.core.errors import KVBenchError
from kvbench.engine.config import EngineConfig
from kvbench.engine.sample import run_sample
from kvbench.engine.session import Session
from kvbench.methods import build_method
from kvbench.methods.duoattention import (
    PATTERN_DIR,
    RELEASE_FILE,
    rank_heads,
    read_pattern,
    release_gates,
    rocketkv_split,
    shipped_patterns,
    write_pattern,
)
from kvbench.tasks.base import Sample, Turn
from kvbench.tasks.haystack import essay_text

GATES = [[0.9, 0.1], [0.2, 0.8]]  # a 2-layer x 2-KV-head pattern: (0, 0) and (1, 1) retrieve first


def pattern_file(tmp_path, gates=GATES, name="p.tsv"):
    path = tmp_path / name
    write_pattern(torch.tensor(gates, dtype=torch.float64), path)
    return str(path)


def decode(session: Session, logits: torch.Tensor, steps: int, check=None) -> list[torch.Tensor]:
    outs = [logits]
    for _ in range(steps):
        outs.append(session.step(int(outs[-1].argmax())))
        if check is not None:
            check(session)
    return outs


def held(session: Session) -> list[list[list[int]]]:
    """Per layer, per KV head, the logical positions stored."""
    out = []
    for layer in session.cache.layers:
        view = layer.head_view()
        out.append([p[p >= 0].tolist() for p in view.positions])
    return out


def test_streaming_heads_hold_sink_plus_recent_and_retrieval_heads_everything(tiny, tmp_path):
    """Sparsity 0.5 of 4 heads: ceil(0.5 * 3) = 2 stream, the two lowest gates; they hold exactly their first
    `sink` and last `recent` positions after the prefill and after every decode step; the others hold all."""
    method = build_method("duoattention", pattern=pattern_file(tmp_path), budget_rule="sparsity", sparsity=0.5,
                          sink=4, recent=16)
    prompt, steps = 120, 8
    session = Session(tiny, method, 64, sequence_length=prompt + steps)
    assert session.plan.derived["retrieval_heads"] == 2 and session.plan.derived["streaming_heads"] == 2
    retrieval = {(0, 0), (1, 1)}
    checked = []

    def check(session):
        seen = session.cache.layers[0].seen
        for li, heads in enumerate(held(session)):
            for h, positions in enumerate(heads):
                if (li, h) in retrieval:
                    assert positions == list(range(seen))
                else:
                    assert positions == list(range(4)) + list(range(seen - 16, seen))
        checked.append(seen)

    logits = session.prefill(random_ids(prompt, seed=3), compress=True)[0]
    check(session)
    decode(session, logits, steps, check)
    assert checked == list(range(prompt, prompt + steps + 1))


def test_rocketkv_rule_mean_per_head_budget_is_t(tmp_path):
    gates = torch.rand(30, 3, generator=torch.Generator().manual_seed(0)).tolist()
    method = build_method("duoattention", pattern=pattern_file(tmp_path, gates))
    heads = 90
    for t, seq in [(700, 4096), (1024, 2048), (2048, 2100), (4000, 32768), (641, 100_000)]:
        plan = method.plan(t, sequence_length=seq, new_tokens=32, head_dim=64, num_layers=30)
        d = plan.derived
        assert (d["sink"], d["recent"]) == (128, 512) and plan.evict == t and plan.select is None
        assert d["rho"] == pytest.approx((t - 640) / (seq - 640))
        assert d["retrieval_heads"] == math.floor(d["rho"] * heads + 0.5)
        mean = (d["retrieval_heads"] * seq + d["streaming_heads"] * 640) / heads
        assert abs(mean - t) <= (seq - 640) / (2 * heads) + 1e-9 and d["mean_head_budget"] == pytest.approx(mean)
        assert len(d["pattern_sha256"]) == 16


def test_rocketkv_rule_holds_t_per_head_on_average_in_a_real_cache(tiny_llama):
    """4 KV heads, S = 1208, t = 640 + (S - 640) / 2: rho = 1/2, so 2 heads keep all S tokens and 2 keep 640."""
    prompt, steps = 1200, 8
    seq = prompt + steps
    t = 640 + (seq - 640) // 2
    method = build_method("duoattention", pattern="tiny_llama")
    session = Session(tiny_llama, method, t, sequence_length=seq)
    assert session.plan.derived["retrieval_heads"] == 2
    decode(session, session.prefill(random_ids(prompt, seed=4), compress=True)[0], steps)
    lengths = [n for layer in session.cache.layers for n in layer.lengths()]
    assert sorted(lengths) == [640, 640, seq, seq] and sum(lengths) / len(lengths) == t
    retrieving = method.retrieval_mask(2)
    assert [n == seq for n in lengths] == retrieving.flatten().tolist()


def test_small_budgets_stream_every_head():
    for t, sink in [(640, 128), (600, 128), (257, 128), (256, 51), (100, 20), (40, 8), (3, 1)]:
        split = rocketkv_split(t, 10_000, 90)
        assert split["retrieval_target"] == 0 and split["sink"] == sink and split["sink"] + split["recent"] == t


def test_every_head_streams_with_the_small_budget_rule_in_a_real_cache(tiny, tmp_path):
    method = build_method("duoattention", pattern=pattern_file(tmp_path))
    session = Session(tiny, method, 40, sequence_length=200 + 4)
    assert (session.plan.derived["sink"], session.plan.derived["recent"]) == (8, 32)
    logits = session.prefill(random_ids(200, seed=5), compress=True)[0]
    decode(session, logits, 4)
    seen = session.cache.layers[0].seen
    assert all(p == list(range(8)) + list(range(seen - 32, seen)) for heads in held(session) for p in heads)


def test_retrieval_heads_are_the_highest_gates_dense_layers_first():
    gates = torch.tensor([[0.5, 0.9, 0.1], [0.7, 0.7, 0.3], [1.0, 0.0, 0.2]], dtype=torch.float64)
    assert rank_heads(gates, 3).tolist() == [[False, True, False], [True, False, False], [True, False, False]]
    # a tie (0.7, 0.7) goes to the lower head index; 4 heads take both
    assert rank_heads(gates, 4)[1].tolist() == [True, True, False]
    # a dense layer's heads all retrieve and count: 4 - 3 = 1 more, the best outside it
    assert rank_heads(gates, 4, dense_rows=[1]).tolist() == [[False, False, False], [True, True, True],
                                                             [True, False, False]]
    assert rank_heads(gates, 0).sum() == 0 and rank_heads(gates, 99).all()


def sparsify_attention_heads(gates: torch.Tensor, sparsity: float, seed: int) -> list:
    """The release's head choice, step by step: `load_attn_pattern` clips, pred.py's `seed_everything(seed)` seeds
    numpy's global generator, `sparsify_attention_heads` adds uniform noise in [0, 1e-6), thresholds at the numpy
    quantile and keeps the heads at or above it."""
    heads = np.clip(gates.numpy(), 0, 1)
    np.random.seed(seed)
    heads = heads + np.random.uniform(0, 1e-6, heads.shape)
    threshold = 2 if sparsity >= 1 else -1 if sparsity <= 0 else np.quantile(heads, sparsity)
    return (heads >= threshold).tolist()


def test_sparsity_rule_chooses_the_releases_heads(tmp_path):
    """DuoAttention's sparsify_attention_heads on the clipped, noised gates: threshold = numpy quantile, heads >= it
    retrieve. Gates rounded to a few values (many ties) and some outside [0, 1], as the released patterns."""
    gates = (torch.rand(30, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 6).round() / 5 - 0.1
    path = pattern_file(tmp_path, gates.tolist())
    for seed in (42, 7):
        for sparsity in (0.0, 0.25, 0.5, 0.75, 0.9, 1.0):
            method = build_method("duoattention", pattern=path, budget_rule="sparsity", sparsity=sparsity, seed=seed)
            d = method.plan(100, sequence_length=5000, new_tokens=0, head_dim=64, num_layers=30).derived
            assert method.retrieval_mask(d["retrieval_heads"]).tolist() == sparsify_attention_heads(gates, sparsity, seed)
            assert (d["sink"], d["recent"]) == (64, 256) and d["tie_break_seed"] == seed


def test_release_gates_are_the_clipped_gates_plus_the_releases_seeded_noise():
    gates = torch.tensor([[1.3, 1.0, 0.5], [-0.2, 0.0, 0.999999]], dtype=torch.float64)
    noisy = release_gates(gates, 42)
    np.random.seed(42)  # what pred.py's seed_everything(42) leaves for sparsify_attention_heads' first draw
    expected = np.clip(gates.numpy(), 0, 1) + np.random.uniform(0, 1e-6, (2, 3))
    assert noisy.tolist() == expected.tolist()  # bitwise the release's values
    assert ((noisy - gates.clamp(0, 1)) < 1e-6).all() and (noisy >= gates.clamp(0, 1)).all()
    assert not torch.equal(release_gates(gates, 43), noisy)


def test_released_mistral_ties_spread_over_the_layers_one_choice_per_seed():
    """Mistral-7B-Instruct-v0.2's released gates: 110 of 256 heads tie at 1.0. RocketKV's rule picks 29 of them at
    t = 1773 on 10,640 tokens; the release's seeded noise spreads them over more than half of the 32 layers (by
    stable order they would all be in layers 0-9), the same heads for the same seed, other tied heads for another."""
    gates = read_pattern(PATTERN_DIR / "mistral_7b_instruct_v0.2.tsv")
    tied = gates.clamp(0, 1) == 1.0
    assert int(tied.sum()) == 110 and gates.shape == (32, 8)
    method = build_method("duoattention", pattern="mistral_7b_instruct_v0.2")  # seed 42, the release's
    plan = method.plan(1773, sequence_length=10_640, new_tokens=0, head_dim=128, num_layers=32).derived
    assert plan["retrieval_heads"] == 29 and plan["tie_break_seed"] == 42
    chosen = rank_heads(gates, 29, seed=42)
    assert plan["retrieval_head_ids"] == torch.nonzero(chosen.flatten()).flatten().tolist()
    assert torch.equal(method.retrieval_mask(29), chosen)
    assert (chosen <= tied).all()  # only tied heads: the noise never outranks a real gate difference
    assert len(set(torch.nonzero(chosen)[:, 0].tolist())) > 16
    assert set(torch.nonzero(rank_heads(gates, 29))[:, 0].tolist()) <= set(range(10))  # the tie order it replaces
    assert torch.equal(rank_heads(gates, 29, seed=42), chosen)
    other = rank_heads(gates, 29, seed=43)
    assert (other <= tied).all() and not torch.equal(other, chosen)
    assert build_method("duoattention", pattern="mistral_7b_instruct_v0.2", seed=43).plan(
        1773, sequence_length=10_640, new_tokens=0, head_dim=128, num_layers=32).derived["retrieval_head_ids"] == \
        torch.nonzero(other.flatten()).flatten().tolist()


def test_the_tie_break_seed_is_the_runs_seed():
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        for seed in (42, 7):
            cfg = compose("config", overrides=["method=duoattention", f"seed={seed}"])
            assert cfg.method.seed == seed
    with pytest.raises(KVBenchError, match="seed"):
        build_method("duoattention", seed=-1)


def test_pattern_round_trip_release_folders_and_errors(tmp_path):
    gates = torch.rand(4, 3, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * 1.2 - 0.1
    path = pattern_file(tmp_path, gates.tolist())
    assert torch.equal(read_pattern(path), gates)  # '%.18e' keeps every bit of a float64
    folder = tmp_path / "Mistral-7B" / "lr=0.02-reg=0.05"
    folder.mkdir(parents=True)
    (folder / RELEASE_FILE).write_text((tmp_path / "p.tsv").read_text())
    assert torch.equal(build_method("duoattention", pattern=str(folder)).gates, gates)
    (tmp_path / "ragged.tsv").write_text("1\t0\n0.5\n")
    (tmp_path / "words.tsv").write_text("1\tzero\n")
    for bad in ("ragged.tsv", "words.tsv"):
        with pytest.raises(KVBenchError, match="pattern"):
            build_method("duoattention", pattern=str(tmp_path / bad))
    for bad in ("no_such_model", str(tmp_path / "missing.tsv")):
        with pytest.raises(KVBenchError, match="pattern.*calibrate duoattention"):
            build_method("duoattention", pattern=bad)
    for bad in (7, ""):
        with pytest.raises(KVBenchError, match="pattern must be"):
            build_method("duoattention", pattern=bad)
    # a pattern of another model: an error naming the calibrate command, before anything is stored
    two_layers = build_method("duoattention", pattern=pattern_file(tmp_path, GATES, "two.tsv"))
    with pytest.raises(KVBenchError, match="2 layers x 2 KV heads, this model 30 x 2.*calibrate"):
        two_layers.plan(700, sequence_length=5000, new_tokens=0, head_dim=64, num_layers=30)


def test_a_pattern_with_other_head_counts_is_refused_at_the_first_eviction(tiny_llama, tmp_path):
    method = build_method("duoattention", pattern=pattern_file(tmp_path, [[1, 0, 0], [0, 1, 0]]))
    session = Session(tiny_llama, method, 40, sequence_length=204)
    with pytest.raises(KVBenchError, match="2 layers x 3 KV heads, this model 2 x 2.*calibrate"):
        session.prefill(random_ids(200, seed=6), compress=True)


def test_shipped_patterns_load_and_match_their_models():
    names = shipped_patterns()
    assert {"smollm2_135m", "tiny_llama", "tiny_qwen3"} <= set(names)
    for name in names:
        gates = read_pattern(PATTERN_DIR / f"{name}.tsv")
        side = json.loads((PATTERN_DIR / f"{name}.json").read_text())
        assert tuple(gates.shape) == (side["layers"], side["kv_heads"]) and side["model"] == name
    assert tuple(read_pattern(PATTERN_DIR / "smollm2_135m.tsv").shape) == (30, 3)
    assert build_method("duoattention").pattern == "smollm2_135m"


@pytest.mark.parametrize("name", ["tiny_llama", "tiny_qwen3"])
def test_budget_at_or_above_the_sequence_is_bitwise_full(request, name):
    lm = request.getfixturevalue(name)
    ids = random_ids(300, seed=7)
    session = Session(lm, build_method("duoattention", pattern=name), 310, sequence_length=310)
    assert session.plan.derived == {"full_attention": True}
    outs = decode(session, session.prefill(ids, compress=True)[0], 6)
    full = Session(lm, build_method("full"), None)
    dense = decode(full, full.prefill(ids, compress=True)[0], 6)
    assert all(torch.equal(a, b) for a, b in zip(outs, dense))
    assert session.cache.evictions() == 0


def test_greedy_decode_runs_and_records_its_plan(tiny_llama):
    context = "".join(random.Random(8).choices("abcdefgh ", k=900))
    sample = Sample(id="s0", task="synthetic", context=context,
                    turns=[Turn("Which letter?", ["a"], max_new_tokens=6, metric="string_match_all")])
    record = run_sample(tiny_llama, build_method("duoattention", pattern="tiny_llama"), 700, sample, EngineConfig())
    plan = record["budget_plan"]
    assert plan["budget_rule"] == "rocketkv" and plan["sink"] == 128 and plan["recent"] == 512
    assert 0 < plan["retrieval_heads"] < 4 and record["compressed"] and record["turns"][0]["prediction"] is not None
    kept = sorted(n for layer in record["kept_tokens_per_head"] for n in layer)
    assert kept[0] == 640 and kept[-1] == record["prompt_tokens"] and kept.count(640) == plan["streaming_heads"]
    # the default cost model: what the heads store, each step (streaming heads: 640 + the new token)
    assert 640 < record["decode_read_tokens_per_group"] < record["prompt_tokens"] + 6


def test_gated_attention_blends_full_and_streaming_attention():
    torch.manual_seed(9)
    q, k, v = torch.randn(1, 4, 40, 8), torch.randn(1, 2, 40, 8), torch.randn(1, 2, 40, 8)
    module = torch.nn.Module()
    module.layer_idx = 0
    state = GateState(torch.nn.Parameter(torch.tensor([[0.25, 1.0]])), sink=3, recent=5)
    i, j = torch.arange(40)[:, None], torch.arange(40)[None, :]

    def eager(mask):
        logits = torch.einsum("bhqd,bhkd->bhqk", q, k.repeat_interleave(2, dim=1)) / math.sqrt(8)
        return torch.softmax(logits.masked_fill(~mask, float("-inf")), -1) @ v.repeat_interleave(2, dim=1)

    full, stream = eager(j <= i), eager((j <= i) & ((j < 3) | (i - j < 5)))
    _ACTIVE.append(state)
    try:
        reference = gated_attention(module, q, k, v, None)[0]
        state.gated = True
        blended = gated_attention(module, q, k, v, None)[0]
    finally:
        _ACTIVE.remove(state)
    torch.testing.assert_close(reference, full.transpose(1, 2), atol=1e-5, rtol=1e-5)
    alpha = torch.tensor([0.25, 0.25, 1.0, 1.0]).view(1, 4, 1, 1)  # query heads 0, 1 belong to KV head 0
    torch.testing.assert_close(blended, (alpha * full + (1 - alpha) * stream).transpose(1, 2), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(full, stream)


def test_passkey_samples_are_seeded_and_supervise_the_answers(tiny_llama):
    settings = CalibrationSettings(num_passkeys=3, passkey_words=2)
    tok = tiny_llama.tokenizer
    ids, supervised = passkey_sample(tok, random.Random(1), 800, settings, essay_text())
    assert len(ids) == 800 and (ids, supervised) == passkey_sample(tok, random.Random(1), 800, settings, essay_text())
    answers = tok.decode([ids[p + 1] for p in supervised])
    text = tok.decode(ids)
    assert text.count("passkey to the vault: ") == 3 and text.count("Passkey: ") == 3
    for n, key in zip(("first", "second", "third"), text.split("Passkey: ")[1:]):
        passkey = key.split("\n")[0]
        assert f"it's the {n} passkey to the vault: {passkey}" in text and passkey in answers


def test_calibration_lowers_the_loss_and_writes_a_pattern_the_method_loads(tiny_llama, tmp_path):
    settings = CalibrationSettings(steps=4, seq_len=560, min_seq_len=480, sink=8, recent=32, num_passkeys=2,
                                   passkey_words=2, seed=3)
    result = calibrate(tiny_llama, settings, essay_text(), progress=False)
    assert result.loss[0] == pytest.approx(settings.reg) and result.distill_loss[0] == 0  # gates of 1: the full model
    assert result.loss[-1] < result.loss[0] and all(0 <= g <= 1 for g in result.gates.flatten().tolist())
    assert tiny_llama.model.config._attn_implementation == "kvbench"
    assert all(p.requires_grad for p in tiny_llama.model.parameters())
    out = save(result, tmp_path / "tiny.tsv", "tiny_llama", settings, "float32")
    side = json.loads(out.with_suffix(".json").read_text())
    assert side["steps"] == 4 and len(side["loss"]) == 4 and side["seed"] == 3 and side["sink"] == 8
    method = build_method("duoattention", pattern=str(out), budget_rule="sparsity", sink=4, recent=8)
    assert torch.equal(method.gates.float(), result.gates)
    session = Session(tiny_llama, method, 40, sequence_length=104)
    decode(session, session.prefill(random_ids(100, seed=10), compress=True)[0], 2)
    assert sorted(min(layer.lengths()) for layer in session.cache.layers)[0] == 12


def test_calibrate_command_composes_its_config_and_writes_the_pattern(tmp_path, capsys):
    from kvbench.cli.calibrate import main

    out = tmp_path / "cli.tsv"
    code = main(["duoattention", "model=tiny_qwen3", "steps=2", "seq_len=500", "min_seq_len=450", "num_passkeys=1",
                 "passkey_words=2", f"out={out}", "show_progress=false"])
    assert code == 0 and str(out) in capsys.readouterr().out
    assert tuple(read_pattern(out).shape) == (2, 2)
    side = json.loads(out.with_suffix(".json").read_text())
    assert side["model"] == "tiny_qwen3" and side["dtype"] == "float32" and side["recent"] == 128
    assert main(["duoattention", "model=tiny_qwen3", "steps=0", f"out={out}"]) == 2
    assert "steps must be a positive integer" in capsys.readouterr().err
