"""The paper models added for issue 46 (Qwen2.5-7B/3B-Instruct, DeepSeek-R1-Distill-Qwen-7B, Llama-3-8B-Instruct
Gradient 1048k) build from their kvbench configs, offline: each config is loaded from a local folder holding a
scaled-down copy of the hub checkpoint's config.json (its architecture, attention and RoPE settings as published,
fewer and narrower layers, random weights) and a byte-level tokenizer, through the same `source: hf` loader."""

from __future__ import annotations

import pytest
import torch
from conftest import model_cfg

from kvbench.engine.session import Session
from kvbench.methods import build_method
from kvbench.models import byte_tokenizer, load_model

# The hub checkpoints' config.json values that decide attention, positions and RoPE (the model cards').
HUB = {
    "qwen2.5_7b_instruct": ("Qwen/Qwen2.5-7B-Instruct", {
        "model_type": "qwen2", "num_attention_heads": 28, "num_key_value_heads": 4, "rope_theta": 1000000.0,
        "max_position_embeddings": 32768, "use_sliding_window": False, "sliding_window": 131072,
        "max_window_layers": 28, "tie_word_embeddings": False}),
    "qwen2.5_3b_instruct": ("Qwen/Qwen2.5-3B-Instruct", {
        "model_type": "qwen2", "num_attention_heads": 16, "num_key_value_heads": 2, "rope_theta": 1000000.0,
        "max_position_embeddings": 32768, "use_sliding_window": False, "sliding_window": 32768,
        "max_window_layers": 70, "tie_word_embeddings": True}),
    "deepseek_r1_distill_qwen_7b": ("deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", {
        "model_type": "qwen2", "num_attention_heads": 28, "num_key_value_heads": 4, "rope_theta": 10000.0,
        "max_position_embeddings": 131072, "use_sliding_window": False, "sliding_window": 4096,
        "max_window_layers": 28, "tie_word_embeddings": False}),
    "llama3_8b_instruct_gradient_1048k": ("gradientai/Llama-3-8B-Instruct-Gradient-1048k", {
        "model_type": "llama", "num_attention_heads": 32, "num_key_value_heads": 8, "rope_theta": 3580165449.0,
        "max_position_embeddings": 1048576, "tie_word_embeddings": False}),
}


def scaled_down_checkpoint(folder, published: dict) -> None:
    """A local checkpoint with the published settings, 2 layers of head dim 8 and a 260-token vocabulary."""
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = dict(published)
    model_type = settings.pop("model_type")
    heads = settings["num_attention_heads"]
    config = AutoConfig.for_model(model_type, hidden_size=8 * heads, intermediate_size=64, num_hidden_layers=2,
                                  head_dim=8, vocab_size=260, **settings)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)


@pytest.mark.parametrize("name", sorted(HUB))
def test_paper_model_config_builds_offline(name, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub_id, published = HUB[name]
    cfg = model_cfg(name)
    assert (cfg.name, cfg.source, cfg.path) == (name, "hf", hub_id)
    assert cfg.max_positions == published["max_position_embeddings"]  # the context the checkpoint's config gives
    scaled_down_checkpoint(tmp_path, published)
    lm = load_model(model_cfg(name, path=str(tmp_path), device="cpu", dtype="float32"))
    config = lm.model.config
    assert lm.max_positions == cfg.max_positions and config.model_type == published["model_type"]
    assert config.rope_parameters["rope_theta"] == published["rope_theta"]
    assert set(getattr(config, "layer_types", None) or ["full_attention"]) == {"full_attention"}
    assert lm.model.use_kernels is False  # transformers' own modules, not the Hub's kernels (kvbench.models)
    session = Session(lm, build_method("snapkv", window=4), 16)  # kvbench's cache and attention run it
    logits, _ = session.prefill(list(range(10, 50)), compress=True)
    tokens, _, _ = session.decode(logits, 4, set(), [])
    assert len(tokens) == 4 and max(session.cache.layers[0].lengths()) <= 16 + 3


def slice_records(tmp_path) -> list[dict]:
    import json

    return [json.loads(line) for path in (tmp_path / "results").rglob("records.jsonl")
            for line in path.read_text().splitlines()]


@pytest.mark.integration
def test_keydiff_table11_cpu_slice(tmp_path):
    """KeyDiff Table 11's twin end to end: the eviction-free row and KeyDiff at one budget on one short RULER task
    (one sample, no NLL pass), laid out as the paper's table: a row per (method, budget), a column per task, then
    their mean."""
    import pandas as pd
    from preset_slice import run_preset_slice

    report = run_preset_slice("keydiff_table11_cpu", tmp_path, "task.seq_len=1024", "task.num_samples=1",
                              "task.subtasks=[niah_single_2]", "engine.nll=false", "method=full,keydiff", "budget=256")
    records = slice_records(tmp_path)
    assert sorted(r["point"]["method"] for r in records) == ["full", "keydiff"]
    keydiff = next(r for r in records if r["point"]["method"] == "keydiff")
    assert keydiff["eviction_schedule"]["block_size"] == 128 and keydiff["kept_tokens_max"] <= 256
    table = pd.read_csv(report / "table.csv", dtype=str, keep_default_na=False)
    # a row per method (one budget swept here), a column per task, then their mean
    assert table.columns[0] == "method" and {"ruler_niah_single_2", "avg"} <= set(table.columns), list(table.columns)
    assert sorted(table["method"]) == ["full", "keydiff"]


@pytest.mark.integration
@pytest.mark.parametrize("preset,method", [("ctkvr_fig6_cpu", "ctkvr"), ("omnikv_fig7_cpu", "omnikv")])
def test_long_context_niah_twins_slice(preset, method, tmp_path):
    """CTKVR Fig. 6's and OmniKV Fig. 7's twins end to end on one (length, depth) cell: the figure's one method,
    its record carrying the cell a heatmap is drawn from."""
    import pandas as pd
    from preset_slice import run_preset_slice

    report = run_preset_slice(preset, tmp_path, "task.lengths=[1024]", "task.depths=[50]", "task.max_new_tokens=10",
                              "engine.nll=false")
    (record,) = slice_records(tmp_path)
    assert record["point"]["method"] == method and record["budget_tokens"] == 128
    assert (record["meta"]["length"], record["meta"]["depth"]) == (1024, 50)
    assert record["prompt_tokens"] <= 1024 and record["decoding"] == {"kind": "greedy"}
    assert len(pd.read_csv(report / "table.csv")) == 1
    assert (report / "niah_heatmap.png").is_file()  # the figure's length x depth heatmap
