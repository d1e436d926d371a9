"""Shared fixtures: tiny random Llama / Qwen3 models (seconds) and the embedded SmolLM2 (integration)."""

from __future__ import annotations

import os

# Triton decides at import whether to interpret; transformers imports it (via torch._dynamo) before any test
# module runs, so the kernel tests' CPU interpreter mode has to be chosen here. KVBENCH_KERNEL_DEVICE=cuda runs
# tests/test_kernels.py's Triton launches compiled on a GPU instead (see that module).
os.environ.setdefault("TRITON_INTERPRET", "1" if os.environ.get("KVBENCH_KERNEL_DEVICE", "cpu") == "cpu" else "0")
# No test may reach the Hub: without this, a dataset lookup retries the network for ~25 s before failing.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from kvbench.models import LoadedModel, load_model  # noqa: E402

CONF = Path(__file__).resolve().parents[1] / "kvbench" / "conf"


def model_cfg(name: str, **overrides):
    cfg = OmegaConf.load(CONF / "model" / f"{name}.yaml")
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value)
    return cfg


@pytest.fixture(scope="session")
def tiny_llama() -> LoadedModel:
    return load_model(model_cfg("tiny_llama"))


@pytest.fixture(scope="session")
def tiny_qwen3() -> LoadedModel:
    return load_model(model_cfg("tiny_qwen3"))


@pytest.fixture(scope="session")
def tiny_llama_deep() -> LoadedModel:
    """A random 6-layer GQA Llama, for what needs depth (PyramidKV's schedule, dense first layers)."""
    return load_model(model_cfg("tiny_llama", **{"config.num_hidden_layers": 6}))


@pytest.fixture(scope="session", params=["tiny_llama", "tiny_qwen3"])
def tiny(request) -> LoadedModel:
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    return load_model(model_cfg("smollm2_135m", device="cpu", dtype="float32"))  # exactness tests: fp32


def random_ids(n: int, seed: int = 0, low: int = 10, high: int = 250) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, (n,), generator=gen).tolist()
