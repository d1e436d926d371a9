"""`kvbench analyze`: the claims' measurements on tiny random models, the verdict rule, the toy example exactly,
and the command (records, resume, verdict.json, figures, report)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch

from kvbench.analysis.base import verdict
from kvbench.analysis.runner import build_claim, claims
from kvbench.analysis.trace import capture, dense_weight, share_for_mass, spearman
from kvbench.cli.analyze import main as analyze
from kvbench.core.errors import KVBenchError
from kvbench.models import load_model
from tests.conftest import model_cfg, random_ids

TINY = ["model=tiny_llama", "task=twostage_retr", "num_samples=3"]


def test_the_list_covers_the_five_papers_with_at_least_ten_claims(capsys):
    assert analyze(["--list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert len(listed) >= 10
    assert {c.paper for c in claims().values()} == {"RocketKV", "Ada-KV", "KeyDiff", "CTKVR", "OmniKV"}


def test_adakv_toy_example_gives_the_papers_numbers_exactly():
    claim = build_claim("adakv_toy", {})
    record = claim.measure_once()
    assert record["allocation"] == [4, 1, 1]
    assert round(record["uniform"], 12) == 2.26 and round(record["adaptive"], 12) == 2.48
    assert verdict(claim, [record], seed=0)["verdict"] == "holds"


@pytest.mark.parametrize("effects,expected", [([0.05, 0.04, 0.06, 0.05], "holds"), ([0.2, 0.3, 0.25], "does_not_hold"),
                                              ([0.05, 0.3, 0.02, 0.25, 0.01], "inconclusive"), ([0.05, 0.04], "inconclusive")])
def test_verdict_compares_the_bootstrap_interval_with_the_threshold(effects, expected):
    claim = build_claim("omnikv_sparsity", {})  # holds below 0.10
    records = [{"effect": e, "first_layers_share": 1.0} for e in effects]
    result = verdict(claim, records, seed=1)
    assert result["verdict"] == expected
    assert result["ci_low"] <= result["effect"] <= result["ci_high"] and result["n"] == len(effects)


def test_one_sample_has_no_interval_and_a_worked_example_is_exact():
    claim = build_claim("omnikv_sparsity", {})
    one = verdict(claim, [{"effect": 0.05, "first_layers_share": 1.0}], seed=1)
    assert (one["ci_low"], one["ci_high"], one["verdict"]) == (None, None, "inconclusive")
    toy = build_claim("adakv_toy", {})
    exact = verdict(toy, [toy.measure_once()], seed=0)
    assert exact["ci_low"] == exact["ci_high"] == exact["effect"]


def test_helpers():
    assert spearman(torch.arange(10.0), torch.arange(10.0) ** 2) == pytest.approx(1.0)
    assert spearman(torch.arange(10.0), -torch.arange(10.0)) == pytest.approx(-1.0)
    assert math.isnan(spearman(torch.ones(5), torch.arange(5.0)))
    assert float(share_for_mass(torch.ones(1, 100), 0.9)) == pytest.approx(0.9)
    assert float(share_for_mass(torch.eye(1, 50), 0.95)) == pytest.approx(1 / 50)
    linear = torch.nn.Linear(12, 7, bias=False)
    assert torch.equal(dense_weight(linear), linear.weight.detach())


def test_trace_keeps_every_query_and_rows_are_causal_distributions(tiny):
    ids = random_ids(96)
    trace = capture(tiny, ids, new_tokens=5)
    layer = trace.layers[0]
    held = len(ids) + len(trace.generated) - 1
    assert layer.keys.shape[1] == held and layer.queries.shape[1] == held
    assert trace.decode_queries.tolist() == list(range(len(ids) - 1, held))
    rows = layer.rows(torch.tensor([3, held - 1]))
    assert torch.allclose(rows.sum(-1), torch.ones_like(rows[..., 0]))
    assert float(rows[:, 0, 4:].abs().max()) == 0.0


@pytest.fixture(scope="module", params=["tiny_llama", "tiny_qwen3"])
def deep(request):
    """Four layers: OmniKV's claims compare the first two layers with the rest."""
    return load_model(model_cfg(request.param, **{"config.num_hidden_layers": 4}))


@pytest.mark.parametrize("name", sorted(n for n, c in claims().items() if c.needs_samples))
def test_every_claim_measures_a_tiny_model(deep, name):
    claim = build_claim(name, {"new_tokens": 6} if build_claim(name, {}).new_tokens else {})
    trace = capture(deep, random_ids(320), claim.new_tokens)
    record = claim.measure(trace, sample=None, seed=0)
    assert math.isfinite(record["effect"])
    json.dumps(record)  # the record is stored as JSON
    plt.close(claim.figure([record, record]))


def test_measured_properties_that_hold_by_construction(tiny_llama_deep):
    trace = capture(tiny_llama_deep, random_ids(320, seed=3), new_tokens=8)
    unique = build_claim("rocketkv_unique_topk", {"k": 16, "new_tokens": 8}).measure(trace, None, 0)
    steps = unique["decode_steps"]
    assert all(16 <= u <= min(16 * steps, unique["sequence_length"]) for layer in unique["unique_per_head"] for u in layer)
    # the oracle S(j -> j) is the best any k tokens can do for layer j
    inter = build_claim("omnikv_interlayer", {"new_tokens": 8}).measure(trace, None, 0)
    matrix = torch.tensor(inter["similarity"])
    assert bool((matrix <= matrix.diagonal()[None, :] + 1e-9).all())
    # alpha = 1 turns Ada-KV's allocation into the uniform one: the same loss
    loss = build_claim("adakv_eviction_loss", {"alpha": 1.0, "budget": 0.3, "new_tokens": 8}).measure(trace, None, 0)
    assert loss["loss_adaptive"] == pytest.approx(loss["loss_uniform"]) and loss["loss_uniform"] > 0
    assert loss["effect"] == 0.0


def test_analyze_writes_records_verdict_and_figure_and_resumes(tmp_path, capsys):
    args = [*TINY, "claim=keydiff_geometry", f"results_dir={tmp_path}", "show_progress=false"]
    assert analyze(args) == 0
    (run_dir,) = list(tmp_path.glob("keydiff_geometry/tiny_llama/*"))
    lines = (run_dir / "measurements.jsonl").read_text().splitlines()
    assert len(lines) == 3 and len({json.loads(line)["sample_id"] for line in lines}) == 3
    result = json.loads((run_dir / "verdict.json").read_text())
    assert {"claim", "paper", "verdict", "effect", "ci_low", "ci_high", "n", "paper_number"} <= set(result)
    assert result["n"] == 3 and result["verdict"] in ("holds", "does_not_hold", "inconclusive")
    assert (run_dir / "keydiff_geometry.png").exists() and (run_dir / "keydiff_geometry.pdf").exists()
    assert "git_sha" in json.loads((run_dir / "manifest.json").read_text())
    assert analyze(args) == 0  # everything recorded: nothing measured twice
    assert len((run_dir / "measurements.jsonl").read_text().splitlines()) == 3
    assert analyze([*args, "num_samples=4"]) == 0  # more samples extend the same records
    assert len((run_dir / "measurements.jsonl").read_text().splitlines()) == 4
    assert json.loads((run_dir / "verdict.json").read_text())["n"] == 4
    assert "keydiff_geometry (KeyDiff" in capsys.readouterr().out


@pytest.mark.parametrize("args,message", [
    (["claim=nope"], "unknown claim 'nope'"),
    (["claim=rocketkv_unique_topk", "params.rocketkv_unique_topk.kk=3"], "unknown parameter(s) kk"),
    ([], "name a claim (claim=NAME)"),
    (["claim=adakv_eviction_loss", "params.adakv_eviction_loss={budget:5000}"], "evicts nothing"),
    (["claim=omnikv_sparsity"], "needs more than 2 layers"),
    (["keydiff_geometry"], "'keydiff_geometry' is not KEY=VALUE: name a claim as claim=NAME"),
    # each was a traceback (int('abc'), numpy's cast of 'x') or read as true
    (["claim=keydiff_geometry", "num_samples=abc"], "num_samples must be a positive number of samples, got 'abc'"),
    (["claim=keydiff_geometry", "seed=x"], "seed must be an integer from 0 to 2**32 - 1, got 'x'"),
    (["claim=keydiff_geometry", "engine.chat_template=maybe"], "engine.chat_template must be true or false"),
    (["claim=keydiff_geometry", "show_progress=maybe"], "show_progress must be true or false"),
    (["claim=keydiff_geometry", "results_dir="], "results_dir must name a directory, got ''"),  # wrote in the cwd
    (["claim=keydiff_geometry", "results_dir=/proc/x"], "results_dir='/proc/x' cannot hold results"),  # a traceback
])
def test_bad_input_is_one_error_line(tmp_path, capsys, args, message):
    assert analyze([*TINY, f"results_dir={tmp_path}", "show_progress=false", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvbench: error:") and message in err


@pytest.mark.parametrize("args,message", [
    (["num_sample=3"], "unknown setting 'num_sample' (did you mean num_samples?)"),
    (["+num_sample=3"], "unknown setting 'num_sample' (did you mean num_samples?)"),
    (["engine.chat_templat=false"], "unknown setting 'engine.chat_templat' (did you mean engine.chat_template?)"),
    (["task.seq_lenn=512"], "unknown setting 'task.seq_lenn' (did you mean task.seq_len?)"),
])
def test_a_mistyped_key_names_the_setting_meant_as_a_run_does(tmp_path, capsys, args, message):
    """The same key check as `python -m kvbench` (kvbench.config.command.check_keys): one line, nothing created."""
    results = tmp_path / "results"
    assert analyze(["claim=keydiff_geometry", *TINY, f"results_dir={results}", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvbench: error: ") and message in err and len(err.strip().splitlines()) == 1
    assert not results.exists()


CLAIMS_PRESETS = sorted(p.stem for p in (Path(__file__).parents[1] / "kvbench" / "conf" / "experiment").glob("claims_*.yaml"))


def test_every_paper_has_a_claims_preset_and_its_cpu_twin():
    papers = {"rocketkv", "adakv", "keydiff", "ctkvr", "omnikv"}
    assert set(CLAIMS_PRESETS) == {f"claims_{p}{twin}" for p in papers for twin in ("", "_cpu")}


@pytest.mark.parametrize("name", CLAIMS_PRESETS)
def test_claims_presets_compose_and_build_their_claims(name):
    from kvbench.cli.analyze import compose

    cfg = compose([f"experiment={name}"])
    for claim in cfg.claims:
        build_claim(claim, dict(cfg.params.get(claim) or {}))
    assert {claims()[c].paper for c in cfg.claims} == {claims()[cfg.claims[0]].paper}
    if name.endswith("_cpu"):
        assert cfg.model.name == "smollm2_135m" and cfg.results_dir == f"results/{name}"
        assert list(cfg.claims) == list(compose([f"experiment={name[:-4]}"]).claims)


def test_a_claims_preset_is_refused_by_a_run():
    from kvbench.config.command import check_command

    with pytest.raises(KVBenchError, match="claims preset"):
        check_command(["experiment=claims_keydiff_cpu", "model=tiny_llama"])


def test_report_collects_the_verdicts_into_one_table(tmp_path):
    from kvbench.cli.report import main as report

    assert analyze([*TINY, "experiment=claims_adakv_cpu", "model=tiny_llama", "task=twostage_retr",
                    "params.adakv_eviction_loss.budget=0.5", f"results_dir={tmp_path}", "show_progress=false"]) == 0
    assert report(["experiment=claims_adakv_cpu", f"results_dir={tmp_path}"]) == 0
    table = (tmp_path / "report" / "claims.md").read_text()
    for claim in ("adakv_toy", "adakv_concentration", "adakv_eviction_loss"):
        assert claim in table
    assert "2.26" in table and (tmp_path / "report" / "adakv_toy.png").exists()
    assert "Claims about attention" in (tmp_path / "report" / "index.html").read_text()


def test_keydiff_key_volume_policies_and_volume(tiny_llama_deep):
    """Fig. 12's three caches: Sink keeps 4 sinks and the most recent rows; one block over the whole prompt is
    one top-B choice by KeyDiff's score or by the last query's group-mean attention; every policy holds exactly
    B distinct rows per head; spread unit keys span more volume than nearly collinear ones."""
    from kvbench.analysis.claims.keydiff_key_volume import block_eviction, key_volume
    from kvbench.methods.keydiff import keydiff_scores

    trace = capture(tiny_llama_deep, random_ids(200, seed=5), new_tokens=0)
    layer, n, budget = trace.layers[1], trace.prompt_len, 48
    sink = block_eviction(layer, n, budget, 32, "sink")
    assert sink[0].tolist() == [0, 1, 2, 3, *range(n - budget + 4, n)]
    whole = {policy: block_eviction(layer, n, budget, n, policy) for policy in ("keydiff", "tova")}
    top = keydiff_scores(layer.keys[:, :n]).topk(budget, dim=-1).indices.sort(dim=-1).values
    assert torch.equal(whole["keydiff"], top)
    q = layer.queries[:, n - 1].view(layer.keys.shape[0], layer.group, -1)
    attention = torch.softmax(torch.einsum("hgd,hld->hgl", q, layer.keys[:, :n]) * layer.scaling, -1).mean(1)
    assert torch.equal(whole["tova"], attention.topk(budget, dim=-1).indices.sort(dim=-1).values)
    for policy in ("keydiff", "tova", "sink"):
        held = block_eviction(layer, n, budget, 32, policy)
        assert held.shape == (layer.keys.shape[0], budget)
        assert all(len(set(row.tolist())) == budget and int(row.max()) < n for row in held)
    spread = torch.eye(16)[None].repeat(1, 4, 1)  # every direction, four times
    collinear = torch.ones(1, 64, 16) + 0.01 * torch.randn(1, 64, 16, generator=torch.Generator().manual_seed(0))
    assert float(key_volume(spread)) > float(key_volume(collinear))


def test_ctkvr_dedup_alpha_is_one_for_one_list_and_at_least_one_over_c_prime(tiny_llama_deep):
    """alpha counts the distinct rows of C' recalled lists of rho rows each: exactly 1 with C' = 1, and between
    1/C' (every list the same) and 1 (disjoint lists) otherwise."""
    trace = capture(tiny_llama_deep, random_ids(400, seed=6), new_tokens=4)
    one = build_claim("ctkvr_dedup_alpha", {"rho": 40, "retrieved": 1, "new_tokens": 4}).measure(trace, None, 0)
    assert one["effect"] == pytest.approx(1.0) and one["decode_steps"] == 4
    four = build_claim("ctkvr_dedup_alpha", {"rho": 40, "new_tokens": 4}).measure(trace, None, 0)
    assert four["centroids"] == 25 and all(0.25 - 1e-9 <= a <= 1.0 for a in four["alpha_per_layer"])


def test_keydiff_key_pca_plane_spread_and_pictures(tiny_llama_deep, tmp_path):
    """Figs. 4, 11: the plane is the keys' top two principal directions (orthonormal, the first at least as
    variable, the same signs on every call); the whole cloud's relative spread is 1, a tight cluster's far less;
    the measure's spreads cover every layer and KV head of the three policies, and its drawings, the first,
    middle and last layer's first head, thinned to `points` rows with each policy's kept flags (Sink's: its 4
    sinks and the most recent rows, so the last drawn row is kept); the figure has a row per drawing."""
    from kvbench.analysis.claims.keydiff_key_pca import pca_plane, spread, thinned_rows

    gen = torch.Generator().manual_seed(0)
    cloud = torch.randn(500, 8, generator=gen) * torch.tensor([5.0, 3.0, 1, 1, 1, 1, 1, 1])
    mean, basis = pca_plane(cloud)
    assert torch.allclose(basis.T @ basis, torch.eye(2, dtype=basis.dtype), atol=1e-9)
    xy = (cloud.double() - mean) @ basis
    assert float(xy[:, 0].var()) >= float(xy[:, 1].var()) and abs(float(basis[0, 0])) > 0.9
    assert torch.equal(pca_plane(cloud)[1], basis)
    near = (xy - xy[0]).norm(dim=-1).argsort()[:50]  # the 50 keys nearest one key
    assert spread(xy) / spread(xy) == 1.0 and spread(xy[near]) < 0.2 * spread(xy)
    assert thinned_rows(10, 4).tolist() == [0, 3, 6, 9] and thinned_rows(3, 10).tolist() == [0, 1, 2]

    trace = capture(tiny_llama_deep, random_ids(200, seed=5), new_tokens=0)
    claim = build_claim("keydiff_key_pca", {"budget": 48, "block": 32, "points": 60})
    record = claim.measure(trace, None, 0)
    layers, heads = len(trace.layers), trace.layers[0].keys.shape[0]
    assert 0.0 <= record["effect"] <= 1.0 and record["budget_tokens"] == 48
    for policy in ("keydiff", "tova", "sink"):
        assert np.asarray(record["spreads"][policy]).shape == (layers, heads)
    drawings = record["drawings"]
    assert [d["layer"] for d in drawings] == sorted({0, layers // 2, layers - 1})
    for d in drawings:
        assert len(d["keys"]) == len(d["joint_keys"]) == len(d["scores"]) == 60
        assert len(d["joint_queries"]) == 60 and len(d["anchor"]) == 2
        assert all(len(flags) == 60 for flags in d["kept"].values()) and d["kept"]["sink"][-1]
        assert d["kept"]["sink"][0] and sum(d["kept"]["keydiff"]) <= 48
    fig = claim.figure([record])
    assert len(fig.axes) == len(drawings) * 4 + len(drawings)  # four panels a row, and Fig. 4's colour bars
    plt.close(fig)
