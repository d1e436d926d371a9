"""Where a model's weights live and in what format: `model.quantization` and `model.device_map`.

Models larger than one device (issue 47):

- `model.quantization`: `none`, `bnb_4bit` (NF4 weights, compute in the model's dtype: OmniKV ran Llama-3.1-70B
  "with 4-bit weight quantization via bitsandbytes", NF4 and bfloat16 compute being transformers' and the QLoRA
  recipe's 4-bit setting; no double quantisation, which the paper does not mention) or `bnb_8bit` (LLM.int8),
  through transformers' `BitsAndBytesConfig`. Only the decoder's linear layers are quantised; embeddings, norms
  and the output head, and so the K/V the cache holds, stay in the compute dtype.
- `model.device_map`: null (the model on `model.device`), `auto` / `balanced` / `balanced_low_0` / `sequential`
  (accelerate's placement over every visible GPU) or an explicit `{module: device}` mapping (`cpu`, `cuda:N`, N,
  or `disk`: offloaded, loaded layer by layer through accelerate's hooks). Each layer's K/V is created by that
  layer's projections, so the cache, the methods' state and the static layout follow the layer's device.
- Every hf / converted-GGUF load passes a device map to `from_pretrained` (`{"": device}` when none is given), so
  shards stream to their device instead of the whole model being built on the host and moved
  (`scripts/bench_load_memory.py` measures the host peak both ways).
- Before anything loads (and before a point's directory exists), `check_placement` refuses a missing
  bitsandbytes, a device map naming an absent device, or weights that cannot fit the devices the placement may
  use, each in one line.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import logging
import os
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from transformers import AutoConfig

from kvbench.core.errors import KVBenchError


def _quant_state_tensors(state: Any) -> list[torch.Tensor]:
    """The tensors of a bitsandbytes `QuantState` (nested for double quantisation), or an LLM.int8 weight's `SCB`."""
    if isinstance(state, torch.Tensor):
        return [state]
    found = [t for t in (getattr(state, "absmax", None), getattr(state, "code", None)) if isinstance(t, torch.Tensor)]
    nested = getattr(state, "state2", None)
    return found + (_quant_state_tensors(nested) if nested is not None else [])


QUANTIZATIONS = ("none", "bnb_4bit", "bnb_8bit")
NAMED_DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")  # accelerate's placement strategies
# Bytes per parameter of a quantised linear layer: NF4 packs two weights a byte plus one float32 absmax per block of
# 64 (bitsandbytes' default blocksize); LLM.int8 one byte plus a float32 scale per output row (negligible).
QUANTIZED_BYTES_PER_PARAMETER = {"bnb_4bit": 0.5 + 4 / 64, "bnb_8bit": 1.0}
# The share of a device's memory the weights may fill: the rest is the K/V cache, activations and the allocator's.
WEIGHT_MEMORY_SHARE = 0.9


def cache_root() -> Path:
    return Path(os.environ.get("KVBENCH_CACHE", Path.home() / ".cache" / "kvbench"))


def present_devices() -> list[str]:
    devices = ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        devices.append("mps")
    return devices

def quantization_of(cfg: Any) -> str:
    """`model.quantization` (absent or null: none), checked."""
    name = str(cfg.get("quantization") or "none")
    if name not in QUANTIZATIONS:
        raise KVBenchError(f"model.quantization={name!r} is not one of {', '.join(QUANTIZATIONS)}")
    return name


def device_map_of(cfg: Any) -> str | dict[str, Any] | None:
    """`model.device_map`: None, a named strategy, or an explicit {module: device} mapping, every device of which
    is present here (`disk`: offloaded to a folder)."""
    raw = cfg.get("device_map")
    if raw is None:
        return None
    if isinstance(raw, str):
        if raw not in NAMED_DEVICE_MAPS:
            raise KVBenchError(f"model.device_map={raw!r} is not one of {', '.join(NAMED_DEVICE_MAPS)} or a "
                               "{module: device} mapping")
        return raw
    mapping = OmegaConf.to_container(raw, resolve=True) if OmegaConf.is_config(raw) else dict(raw)
    if not isinstance(mapping, dict) or not mapping:
        raise KVBenchError(f"model.device_map={raw!r}: expected {', '.join(NAMED_DEVICE_MAPS)} or a non-empty "
                           "{module: device} mapping")
    present = present_devices()
    for module, device in mapping.items():
        name = f"cuda:{device}" if isinstance(device, int) and not isinstance(device, bool) else str(device)
        name = "cuda:0" if name == "cuda" else name
        if name != "disk" and name not in present:
            raise KVBenchError(f"model.device_map puts {module!r} on {device!r}, which is not present on this "
                               f"machine; devices here: {', '.join(present)} (and disk)")
    return mapping


@contextlib.contextmanager
def _hub_kernels_hidden() -> Iterator[None]:
    """Hugging Face's `kernels` package unimportable for the duration (`from kernels import ...` raises
    ImportError), then as it was.

    On AVX512-BF16 CPUs, bitsandbytes' import fetches an NF4 product from the Hub (`kernels.get_kernel(
    "kernels-community/quantization-bitsandbytes")`) wherever `kernels` is installed, which transformers 5.25
    made every environment: a CPU NF4 run's products, and so its numbers, would then depend on whether the Hub
    answered at import (and an offline one printed a line before kvbench's). Without it bitsandbytes uses the CPU
    kernels of its installed version, which the manifest records."""
    missing = object()
    saved = sys.modules.get("kernels", missing)
    sys.modules["kernels"] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        if saved is missing:
            del sys.modules["kernels"]
        else:
            sys.modules["kernels"] = saved  # type: ignore[assignment]


def bitsandbytes_missing(quantization: str) -> str | None:
    """Why `quantization` cannot run here (bitsandbytes absent or broken), or None. bitsandbytes is imported here
    first, with its own CPU kernels (`_hub_kernels_hidden`)."""
    if quantization == "none":
        return None
    # without the hub kernel bitsandbytes' CPU backend warns that it is absent: not the user's concern
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    try:
        with _hub_kernels_hidden():
            importlib.import_module("bitsandbytes")
    except Exception as exc:  # noqa: BLE001 - an install that fails to import is as missing as an absent one
        return (f"model.quantization={quantization} needs bitsandbytes, which is not importable here "
                f"({type(exc).__name__}): pip install 'kvbench[quant]' (or pip install bitsandbytes)")
    return None


def check_placement(cfg: Any, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse, in one line and before anything loads, a quantisation bitsandbytes cannot run here, a device map
    naming an absent device, or weights larger than the memory of the devices the placement may use
    (`weight_bytes_estimate` against `available_memory`); the checks that need no download."""
    quantization = quantization_of(cfg)
    device_map = device_map_of(cfg)
    missing = bitsandbytes_missing(quantization)
    if missing:
        raise KVBenchError(missing)
    if cfg.get("source") != "hf":
        return  # a tiny or embedded model: no size worth checking
    needed = weight_bytes_estimate(cfg, dtype, quantization)
    if needed is None:
        return  # neither the size nor a readable config: the load itself says what is missing
    available, where = available_memory(device, device_map)
    if available is not None and needed > WEIGHT_MEMORY_SHARE * available:
        hint = "" if quantization != "none" else " or model.quantization=bnb_4bit"
        raise KVBenchError(
            f"model {cfg.name} needs about {needed / 2**30:.1f} GiB for its weights ({quantization}, "
            f"{str(dtype).replace('torch.', '')} compute) but {where} offer {available / 2**30:.1f} GiB "
            f"({WEIGHT_MEMORY_SHARE:.0%} of it for weights): run it where more GPU memory is visible (docs/cluster.md "
            f"gives the resources per model size){hint}, or give model.device_map with disk offload")


def weight_bytes_estimate(cfg: Any, dtype: torch.dtype, quantization: str) -> int | None:
    """The weights' bytes once loaded: the node's `size` (`parameters`, `embedding_parameters`: known before any
    download) or, failing that, counted from a config.json reachable without the network; the decoder's linear
    layers at the quantised size, the embeddings and output head at the compute dtype's."""
    size = cfg.get("size")
    if size is not None:
        total, embedding = int(size.parameters), int(size.get("embedding_parameters") or 0)
    else:
        counted = _parameters_from_config(cfg)
        if counted is None:
            return None
        total, embedding = counted
    element = torch.finfo(dtype).bits // 8
    if quantization == "none":
        return total * element
    return int((total - embedding) * QUANTIZED_BYTES_PER_PARAMETER[quantization]) + embedding * element


def _parameters_from_config(cfg: Any) -> tuple[int, int] | None:
    """(all parameters, embedding + output-head parameters) of a Llama-like decoder from its config.json, read
    from a local directory or the hub cache only (no download)."""
    path = cfg.get("path")
    if cfg.get("source") != "hf" or not path:
        return None
    try:
        config = AutoConfig.from_pretrained(str(Path(path).expanduser()) if Path(path).expanduser().exists()
                                            else path, local_files_only=True)
        hidden, layers = int(config.hidden_size), int(config.num_hidden_layers)
        heads, kv_heads = int(config.num_attention_heads), int(config.num_key_value_heads or config.num_attention_heads)
        head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
        inner, vocab = int(config.intermediate_size), int(config.vocab_size)
    except (OSError, ValueError, AttributeError, TypeError):
        return None
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)
    mlp = 3 * hidden * inner
    embedding = vocab * hidden * (1 if getattr(config, "tie_word_embeddings", False) else 2)
    return layers * (attention + mlp + 2 * hidden) + hidden + embedding, embedding


def available_memory(device: torch.device, device_map: str | dict[str, Any] | None) -> tuple[int | None, str]:
    """(bytes, which devices) the weights may fill: the one device without a device map; every visible GPU for a
    named strategy (the host when there is none); the devices an explicit mapping names (None: it offloads to
    disk, which bounds nothing). A GPU counts its total memory, the host its available memory."""
    if isinstance(device_map, dict):
        names = {f"cuda:{d}" if isinstance(d, int) else ("cuda:0" if str(d) == "cuda" else str(d))
                 for d in device_map.values()}
        if "disk" in names:
            return None, "disk offload"
        devices = [torch.device(n) for n in sorted(names)]
    elif device_map is not None and torch.cuda.is_available():
        devices = [torch.device(f"cuda:{i}") for i in range(torch.cuda.device_count())]
    elif device_map is not None:
        devices = [torch.device("cpu")]
    else:
        devices = [device]
    total = sum(_device_memory(d) for d in devices)
    return total, " + ".join(_describe_device(d) for d in devices)


def _device_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device.index or 0).total_memory)
    return host_available_bytes()


def _describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device.index or 0)})"
    return f"{device.type} (host memory available)"


def host_available_bytes() -> int:
    """The host memory available to a new allocation (`MemAvailable`; free pages where /proc is absent)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@dataclass
class Placement:
    """How a model's weights are stored and where they go (`model.quantization`, `model.device_map`)."""
    device: torch.device
    dtype: torch.dtype
    quantization: str
    device_map: str | dict[str, Any] | None
    name: str

    def from_pretrained_kwargs(self) -> dict[str, Any]:
        """`from_pretrained`'s placement arguments: always a device map (shards stream to their device; `{"":
        device}` without one), the quantisation config, and an offload folder where the map offloads to disk."""
        kwargs: dict[str, Any] = {"device_map": self.device_map if self.device_map is not None
                                  else {"": str(self.device)}}
        if self.device_map is not None:
            kwargs["offload_folder"] = str(offload_folder(self.name))
        config = quantization_config(self.quantization, self.dtype)
        if config is not None:
            kwargs["quantization_config"] = config
        return kwargs

    @property
    def plain(self) -> bool:
        return self.quantization == "none" and self.device_map is None


def quantization_config(quantization: str, compute_dtype: torch.dtype) -> Any:
    """transformers' `BitsAndBytesConfig` for `quantization` (None for none): NF4 with the model's dtype as compute
    dtype (bfloat16 in OmniKV's 70B setting), or LLM.int8."""
    if quantization == "none":
        return None
    from transformers import BitsAndBytesConfig

    if quantization == "bnb_4bit":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute_dtype,
                                  bnb_4bit_use_double_quant=False)
    return BitsAndBytesConfig(load_in_8bit=True)


def offload_folder(name: str) -> Path:
    """Where a device map's `disk` entries put their weights (and a tiny model its saved copy, which disk offload
    of a safetensors checkpoint reads in place): per model and process, under the kvbench cache, removed when the
    process exits."""
    folder = cache_root() / "offload" / f"{name}-{os.getpid()}"
    if not folder.exists():
        folder.mkdir(parents=True)
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder
