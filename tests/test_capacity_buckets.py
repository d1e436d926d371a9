"""The static layout's capacities (`kvbench.cache.static.bucketed`): a geometric series, so that a sweep over prompt
lengths compiles a few graphs per method, not one per 256 rows; and the sweep's closing table shows what compiling
cost.

Graph counts come from dynamo's "eager" backend (as in tests/test_static_decode.py): it traces the whole step and
keys its graphs as inductor does, in seconds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kvbench.cache.static as static
import kvbench.engine.compiled as compiled
from kvbench.cache.static import CAPACITY_BUCKET, bucketed
from kvbench.engine.config import EngineConfig
from kvbench.engine.sample import run_sample
from kvbench.methods import build_method
from kvbench.methods.common.dims import RuntimeDims
from kvbench.methods.common.pages import RuntimePage, top_page_tokens
from kvbench.methods.hsa import HSALength, hsa_parameters
from kvbench.methods.quest import QuestPage
from kvbench.models import load_model
from kvbench.reporting.table import point_table, report_text
from kvbench.results.collect import collect
from kvbench.results.store import RecordStore, point_hash
from kvbench.tasks.base import Sample, Turn
from tests.conftest import model_cfg

# a sweep's prompt lengths: 12 between 1K and 8K tokens, evenly spaced
LENGTHS = [round(1024 + i * (8192 - 1024) / 11) for i in range(12)]
NEW = 2  # decode steps per sample: the loop's capacity is the prompt plus these
ENGINE = EngineConfig(compile=True, nll=False, topk_recall=False, reuse_prefill=False)


def test_the_series_is_powers_of_two_from_the_floor():
    assert CAPACITY_BUCKET == 256 and static.CAPACITY_GROWTH == 2
    assert [bucketed(n) for n in (0, 1, 256, 257, 512, 513, 1000, 1024, 1025, 8192, 8193, 131_072 + 64)] == [
        256, 256, 256, 512, 512, 1024, 1024, 1024, 2048, 8192, 16_384, 262_144]
    needed = range(0, 140_000)
    capacities = [bucketed(n) for n in needed]
    assert all(c >= n and c % CAPACITY_BUCKET == 0 for n, c in zip(needed, capacities))
    assert all(a <= b for a, b in zip(capacities, capacities[1:]))  # monotonic
    series = sorted(set(capacities))
    assert series == [256 * 2**k for k in range(len(series))]
    # no more than twice what is needed, past the floor
    assert all(c < 2 * n for n, c in zip(needed, capacities) if n > CAPACITY_BUCKET)


@pytest.mark.parametrize("decode", [0, 64, 256])
def test_a_1k_to_8k_sweep_falls_into_at_most_five_capacities(decode):
    """Every prompt of 1K..8K tokens plus a loop's decode steps: 4 or 5 capacities, where 256-row steps took 29
    to 30 (and 1K..128K: 9 against 510)."""
    prompts = range(1000, 8193)
    assert len({bucketed(n + decode) for n in prompts}) <= 5
    assert len({bucketed(n + decode, growth=1) for n in prompts}) >= 28
    assert len({bucketed(n + decode) for n in range(1024, 131_073)}) <= 9


def test_the_growth_is_a_module_setting_read_at_every_call(monkeypatch):
    assert [bucketed(n, growth=1) for n in (1, 256, 257, 1000)] == [256, 256, 512, 1024]  # the old linear steps
    monkeypatch.setattr(static, "CAPACITY_GROWTH", 1.25)
    finer = sorted({bucketed(n) for n in range(1, 20_000)})
    assert finer[:8] == [256, 512, 768, 1024, 1280, 1792, 2304, 3072]
    assert all(b <= 1.25 * a + CAPACITY_BUCKET for a, b in zip(finer, finer[1:]))
    with pytest.raises(ValueError, match="growth"):
        bucketed(100, growth=0.5)


@pytest.fixture(scope="module")
def sweep_llama():
    """A one-layer tiny random Llama of its own (a fresh decoder: no graph from another test is reused) that
    takes 8K prompts plus their decode steps."""
    return load_model(model_cfg("tiny_llama", **{"config.max_position_embeddings": 16_384,
                                                 "config.num_hidden_layers": 1}))


def synthetic(length: int) -> Sample:
    return Sample(id=f"s{length}", task="synthetic", context="", chat_template=False,
                  turns=[Turn(question="", answers=[], max_new_tokens=NEW, metric="none")],
                  token_prompt={"kind": "random", "length": length, "seed": length}, meta={"min_new_tokens": NEW})


@pytest.mark.parametrize("method,settings,budget", [
    ("full", {}, 64),  # uniform: every prompt token kept
    ("adakv", {"window": 8}, 0.5),  # ragged: half of each layer's tokens, spread over the heads by score
    # a selection over the whole cache (pages at the same capacity): the release's fixed 16-token page, and the
    # default traffic-equivalent page round(2 S / t), a new size at every prompt length, a runtime input of the
    # step (`kvbench.methods.common.pages.RuntimePage`; 12 graphs here while it was a Python number)
    ("quest", {"page_size": 16}, 64),
    ("quest", {}, 64),
    ("quest", {}, 100),
    # HSA's page ceil(sqrt(S / t)) and estimate dimensions int(D p / (S / t)), runtime inputs too (10 and 9 graphs
    # here while they were Python numbers); RocketKV's, of its stage-1 capacity (7 graphs at 256)
    ("hsa", {}, 64),
    ("hsa", {}, 256),
    ("rocketkv", {"window": 8}, 256),
    # SparQ's r = round(D t / S), a runtime input (at a budget near the lengths, where r takes many values)
    ("sparq", {}, 1000),
])
def test_a_sweep_of_twelve_prompt_lengths_compiles_at_most_five_graphs(sweep_llama, monkeypatch, method, settings,
                                                                        budget):
    """One point per prompt length (each its own method object, as a sweep's points are), compiled: the records'
    `decode_compiles` over the sweep, which dynamo's graph counter confirms. 4 graphs each (2K, 4K, 8K, 16K
    rows). Ada-KV's ragged layers are keyed by their total rows here; their view's width (the longest head plus
    room) is a shape of the graph only where the step reads it (the split-K kernel on CUDA)."""
    monkeypatch.setattr(compiled, "BACKEND", "eager")
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    records = [run_sample(sweep_llama, build_method(method, **settings), budget, synthetic(n), ENGINE)
               for n in LENGTHS]
    assert all(r["decode_path"] == "compiled" for r in records), records[0]["decode_path_reason"]
    assert [r["prompt_tokens"] for r in records] == LENGTHS
    compiles = sum(r["decode_compiles"] for r in records)
    assert compiles == torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs
    # the capacities really span the sweep: more than one graph, at most five
    assert 2 <= compiles <= 5, [(r["prompt_tokens"], r["decode_compiles"]) for r in records]
    if method == "quest" and not settings:  # the page size differs at (almost) every length; the graphs do not
        assert len({r["budget_plan"]["page_size"] for r in records}) >= 10, [r["budget_plan"] for r in records]
    if method in ("hsa", "rocketkv"):  # so do the page and the estimate dimensions
        plans = {(r["budget_plan"]["page_size"], r["budget_plan"]["k1"]) for r in records}
        assert len(plans) >= 7 and len({k1 for _, k1 in plans}) >= 3, plans
    if method == "sparq":
        assert len({r["budget_plan"]["r"] for r in records}) >= 7, [r["budget_plan"] for r in records]
    if method not in ("adakv", "rocketkv"):  # every token kept: one graph per capacity of the prompt plus the loop
        assert compiles == len({bucketed(n + NEW + 1) for n in LENGTHS})
    assert sum(r["decode_compile_s"] for r in records) > 0
    assert len({bucketed(n + NEW + 1, growth=1) for n in LENGTHS}) == 12  # 256-row steps: a graph per length


def write_point(root: Path, method: str, path: str, compile_s: list[float]) -> None:
    point = {"model": "tiny", "task": "synthetic", "method": method, "budget": 64, "decode_path": path}
    store = RecordStore(root / method / path)
    for i, seconds in enumerate(compile_s):
        store.append({"sample_id": f"s{i}", "task": "synthetic", "score": None, "decode_ms_per_token": 5.0 + i,
                      "decode_compiles": int(seconds > 0), "decode_compile_s": seconds, "point": point,
                      "point_hash": point_hash(point)})


def test_the_closing_table_shows_compile_seconds_beside_decode_time(tmp_path: Path):
    write_point(tmp_path, "full", "compiled", [12.5, 0.0, 20.0])  # a second bucket compiled at the third sample
    write_point(tmp_path, "quest", "compiled", [30.25, 0.0, 0.0])
    write_point(tmp_path, "snapkv", "eager", [0.0, 0.0, 0.0])
    table = point_table(collect(tmp_path)).set_index("method")
    assert table.loc["full", "decode_compile_s"] == pytest.approx(32.5)  # the total, not the mean
    assert table.loc["snapkv", "decode_compile_s"] == 0.0
    lines = report_text(tmp_path).splitlines()
    header = lines[1].split()
    assert header[-3:] == ["ms/token", "compile", "s"]  # compile seconds right after the decode time
    rows = {line.split()[0]: line.split() for line in lines[2:]}
    assert rows["full"][-2:] == ["6.00", "32.5"] and rows["quest"][-1] == "30.2" and rows["snapkv"][-1] == "0.0"
    # an eager sweep compiles nothing: no column of zeros, and no "decode_compile_s 0.0" in the note
    eager = tmp_path / "eager_only"
    write_point(eager, "snapkv", "eager", [0.0, 0.0])
    text = report_text(eager)
    assert "compile" not in text and "ms/token" in text


@pytest.mark.parametrize("seed", range(40))
def test_a_runtime_page_selects_the_tokens_of_the_page_as_a_number(seed):
    """`RuntimePage.top_tokens` (the page a tensor, the shapes fixed by the capacity and the budget) against
    `top_page_tokens` with the page as a Python number, over the same static capacity: the same tokens in the
    same order, a head's partial last page anywhere in the order, whole last pages, ties."""
    gen = torch.Generator().manual_seed(seed)
    width = int(torch.randint(256, 4096, (1,), generator=gen))
    budget = int(torch.randint(8, width // 2, (1,), generator=gen))
    k = budget // 2
    length = int(torch.randint(budget + 1, width + 1, (1,), generator=gen))  # the S the page is derived from
    page = max(1, round(2 * length / budget))
    heads = 3
    runtime = RuntimePage.at(width, page, QuestPage(budget, k), torch.device("cpu"))
    fill = torch.randint(max(k, length // 2), length + 1, (heads,), generator=gen)
    if seed % 4 == 0:
        fill[0] = (int(fill[0]) // page) * page or page  # a whole last page
    scores = torch.randn(heads, runtime.pages, generator=gen).round(decimals=1)  # ties
    if seed % 3 == 0:  # put each head's partial page first
        scores[torch.arange(heads), fill // page] = 10.0
    first_rows = torch.arange(runtime.pages) * page
    scores = scores.masked_fill(first_rows[None, :] >= fill[:, None], float("-inf"))
    exact = -(-width // page)
    assert runtime.pages >= exact and runtime.ordered >= min(exact, k // page + 2)
    expected = top_page_tokens(scores[:, :exact], page, fill, k)
    assert torch.equal(runtime.top_tokens(scores, fill, k), expected)


def test_runtime_page_counts_depend_on_the_capacity_and_budget_alone():
    """Every prompt length whose loop fits a capacity gives the same page count and pages ordered, so one graph;
    a loop outside the rule (rows longer than the S of the page) its own counts, still covering the capacity."""
    budget, k, width = 64, 32, 4096
    rule = QuestPage(budget, k)
    shapes = {(r.pages, r.ordered) for r in (RuntimePage.at(width, rule.page(s), rule, torch.device("cpu"))
                                             for s in range(2049, 4097))}
    assert len(shapes) == 1
    short = RuntimePage.at(width, rule.page(600), rule, torch.device("cpu"))
    assert short.pages * int(short.page) >= width and short.ordered >= k // int(short.page) + 2


@pytest.mark.parametrize("budget,head_dim", [(64, 16), (64, 128), (256, 128), (1024, 128), (100, 64), (7, 32)])
def test_hsa_most_dims_is_the_largest_k1_of_the_lengths(budget, head_dim):
    """`HSALength.most_dims` (from where the page steps up) against every length of each capacity's range, and
    the runtime page's counts: the same for every length whose loop fits the capacity, and enough for its k1."""
    k1 = lambda n: hsa_parameters(n / budget, head_dim)["k1"]  # noqa: E731
    for width in (256, 512, 2048, 8192, 32_768):
        rule = HSALength(budget, budget // 2, head_dim, dims=1)
        assert rule.most_dims(width // 2, width) == max(k1(n) for n in range(width // 2, width + 1)), width
        counts = set()
        for n in range(width // 2 + 1, width + 1, 7):
            plan = hsa_parameters(n / budget, head_dim)
            runtime = RuntimePage.at(width, plan["page_size"], HSALength(budget, budget // 2, head_dim, plan["k1"]),
                                     torch.device("cpu"))
            assert int(runtime.dims.value) == plan["k1"] <= runtime.dims.count
            assert int(runtime.page) == plan["page_size"]
            counts.add((runtime.pages, runtime.ordered, runtime.dims.count))
        assert len(counts) == 1, (width, counts)


@pytest.mark.parametrize("method,settings,budget", [("hsa", {}, 64), ("rocketkv", {}, 256), ("sparq", {}, 1000),
                                                    ("sparq", {"granularity": "head"}, 1000)])
def test_runtime_page_and_dims_keep_the_eager_tokens_and_traffic(sweep_llama, monkeypatch, method, settings, budget):
    """HSA, RocketKV and SparQ compiled with the page and the estimate's dimensions (k1, r) as runtime inputs, at
    prompt lengths where the step takes more dimensions than the plan's (the rest zeroed) and the page is not
    the capacity's smallest: the eager path's tokens and the traffic the plan gives."""
    monkeypatch.setattr(compiled, "BACKEND", "eager")
    eager_engine = EngineConfig(compile=False, nll=False, topk_recall=False, reuse_prefill=False)
    seen = []
    real_at = RuntimePage.at.__func__
    monkeypatch.setattr(RuntimePage, "at", classmethod(lambda cls, *a: seen.append(real_at(cls, *a)) or seen[-1]))
    dims_seen = []
    real_dims = RuntimeDims.at.__func__
    monkeypatch.setattr(RuntimeDims, "at", classmethod(lambda cls, *a: dims_seen.append(real_dims(cls, *a))
                                                       or dims_seen[-1]))
    for length in (1300, 2327, 3000):
        sample = synthetic(length)
        sample.turns[0].max_new_tokens = sample.meta["min_new_tokens"] = 8
        runs = [run_sample(sweep_llama, build_method(method, **settings), budget, sample, engine)
                for engine in (ENGINE, eager_engine)]
        assert [r["decode_path"] for r in runs] == ["compiled", "eager"]
        assert runs[0]["turns"][0]["prediction"] == runs[1]["turns"][0]["prediction"]
        for key in ("decode_read_bytes_per_step", "decode_read_tokens_per_group", "decode_attended_tokens_per_head"):
            assert runs[0][key] == runs[1][key], key
    if method == "sparq":  # its runtime r is its transposed keys' (`TransposedKeys.runtime_dims`)
        assert not seen and any(int(d.value) < d.count for d in dims_seen)
        return
    assert any(int(r.dims.value) < r.dims.count for r in seen) and any(int(r.page) * r.pages > r.width for r in seen)


@pytest.mark.parametrize("method,budget,warned", [("quest", "0.25", True), ("quest", "64", False),
                                                  ("snapkv", "0.25", False), ("sparq", "compression_ratio=0.5", True)])
def test_a_compiled_selection_with_a_ratio_budget_says_it_compiles_per_length(tmp_path, caplog, method, budget,
                                                                              warned):
    """A ratio budget gives each prompt length its own t, and the t / 2 tokens a selection attends are a shape of
    the compiled graph (the 12-length sweep above compiles 11 graphs with budget=0.25): the point says so in one
    line before it runs. A token budget, or an eviction method's ratio (its kept rows sit in the capacity), does
    not."""
    from hydra import compose, initialize_config_dir

    from kvbench.run.prepare import prepare_point
    from tests.conftest import CONF

    budget_override = budget if budget.startswith("compression_ratio") else f"budget={budget}"
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=["model=tiny_llama", f"method={method}", budget_override, "task=niah",
                                           "task.seq_len=1200", "task.num_samples=1", "task.depths=[0,50]", "engine.compile=true", f"results_dir={tmp_path}"])
    with caplog.at_level("WARNING", logger="kvbench"):
        prepared = prepare_point(cfg, tmp_path / "point")
    assert len(prepared.samples) > 1
    lines = [r.getMessage() for r in caplog.records if "compiles a graph for each prompt length" in r.getMessage()]
    assert len(lines) == warned, caplog.text
