"""Placement through `model.device_map` (issue 47): a tiny model whose layers are dispatched by accelerate, one of
them offloaded to disk (weights swapped in by accelerate's hooks at every forward, the closest a CPU comes to
several devices), records what the plain model records; bad placements are refused in one line, nothing written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import model_cfg
from hydra.utils import instantiate
from omegaconf import OmegaConf

from kvbench.core.errors import KVBenchError
from kvbench.engine.compiled import SHARDED_REASON, decoder_for
from kvbench.engine.config import EngineConfig
from kvbench.engine.prompt import PromptBuilder
from kvbench.engine.sample import run_sample
from kvbench.methods import build_method
from kvbench.models import available_memory, load_model, weight_bytes_estimate

CONF = Path(__file__).resolve().parents[1] / "kvbench" / "conf"

# layer 1 offloaded to disk: its weights live on the meta device between forwards, loaded by its AlignDevicesHook
OFFLOADED = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu",
             "model.layers.1": "disk", "model.norm": "cpu", "lm_head": "cpu"}
METHODS = [("full", {}, 64), ("snapkv", {}, 32), ("adakv", {}, 32), ("quest", {}, 32), ("omnikv", {"filter_layers": [0]}, 16)]


@pytest.fixture(scope="module")
def offloaded():
    return load_model(model_cfg("tiny_llama", device_map=OFFLOADED))


def _sample(lm):
    task_cfg = OmegaConf.load(CONF / "task" / "twostage_retr.yaml")
    task_cfg.num_samples, task_cfg.max_new_tokens = 1, 8
    task = instantiate(task_cfg, _convert_="all")
    task.max_positions = lm.max_positions
    return task.samples(PromptBuilder(lm.tokenizer).measure, seed=5)[0]


def test_the_offloaded_layer_is_really_swapped_in_by_a_hook(offloaded):
    layer = offloaded.model.model.layers[1].self_attn.q_proj
    assert layer.weight.device.type == "meta" and hasattr(offloaded.model.model.layers[1], "_hf_hook")
    assert offloaded.sharded and offloaded.placement["model.layers.1"] == "disk"
    assert offloaded.record_fields() == {"device_map": offloaded.placement}
    assert offloaded.device == torch.device("cpu") and offloaded.dtype == torch.float32


@pytest.mark.parametrize("name,params,budget", METHODS, ids=[m[0] for m in METHODS])
def test_offloaded_model_gives_the_plain_models_tokens_and_nll(tiny_llama, offloaded, name, params, budget):
    sample = _sample(tiny_llama)
    plain = run_sample(tiny_llama, build_method(name, **params), budget, sample, EngineConfig())
    placed = run_sample(offloaded, build_method(name, **params), budget, sample, EngineConfig())
    assert [t["prediction"] for t in placed["turns"]] == [t["prediction"] for t in plain["turns"]]
    assert [t["nll"] for t in placed["turns"]] == [t["nll"] for t in plain["turns"]]  # bitwise: same float32 kernels
    assert placed["kv_bytes_end"] == plain["kv_bytes_end"] > 0


def test_a_sharded_model_decodes_eagerly_and_says_why(offloaded):
    assert decoder_for(offloaded, backend="eager").failure(build_method("full")) == SHARDED_REASON


def test_a_device_map_naming_an_absent_device_is_refused():
    with pytest.raises(KVBenchError, match=r"puts 'model.layers.1' on 'cuda:7', which is not present.*devices here: cpu"):
        load_model(model_cfg("tiny_llama", device_map={**OFFLOADED, "model.layers.1": "cuda:7"}))
    with pytest.raises(KVBenchError, match="model.device_map='everywhere' is not one of auto"):
        load_model(model_cfg("tiny_llama", device_map="everywhere"))


def test_the_70b_estimate_counts_4bit_linear_layers_and_bf16_embeddings():
    cfg = model_cfg("llama3.1_70b_instruct")
    four_bit = weight_bytes_estimate(cfg, torch.bfloat16, "bnb_4bit")
    bf16 = weight_bytes_estimate(cfg, torch.bfloat16, "none")
    assert bf16 == 2 * 70553706496
    embedding = 2101346304
    assert four_bit == int((70553706496 - embedding) * (0.5 + 4 / 64)) + 2 * embedding
    assert 39 * 2**30 < four_bit < 41 * 2**30  # fits one 80 GB GPU, not a 40 GB one
    total, where = available_memory(torch.device("cpu"), None)
    assert total > 0 and "cpu" in where


def _kvbench(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvbench", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env=env)


@pytest.mark.parametrize("args,message", [
    (["model=tiny_llama", "+model.device_map={model.layers.0: cuda:3}"], "puts 'model.layers.0' on 'cuda:3'"),
    (["model=llama3.1_70b_instruct"], "model llama3.1_70b_instruct needs about 39."),
    (["model=llama3.1_70b_instruct", "model.quantization=none"], "needs about 131.4 GiB"),
])
def test_bad_placement_is_one_error_line_and_nothing_is_written(tmp_path, args, message):
    if torch.cuda.is_available() and "70b" in args[0]:
        pytest.skip("the memory check depends on the GPUs present")
    result = _kvbench(*args, "task=twostage_retr", f"results_dir={tmp_path}", cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("kvbench: error: ") and message in lines[0], lines
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]


def test_a_profiled_sample_counts_the_weights_where_they_are_stored(tiny_llama, offloaded):
    from kvbench.profiling.profiler import PhaseProfiler

    sample = _sample(offloaded)
    record = run_sample(offloaded, build_method("snapkv"), 32, sample, EngineConfig(),
                        profiler=PhaseProfiler(offloaded.device, devices=offloaded.devices()))
    by_device = record["profile"]["weights_bytes_by_device"]
    layer_one = sum(p.numel() * p.element_size() for p in tiny_llama.model.model.layers[1].parameters())
    assert by_device["meta"] == layer_one  # the disk-offloaded layer: held by its hook, counted once
    total = sum(p.numel() * p.element_size() for p in tiny_llama.model.parameters())
    assert record["profile"]["weights_bytes"] == sum(by_device.values()) == total
