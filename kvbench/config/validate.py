"""The one set of argument checks: every top-level, engine and generic task setting, the chosen groups and
their settings, and prompt lengths against the model, each refused with one line naming the setting."""

from __future__ import annotations

import difflib
import functools

from omegaconf import DictConfig

from kvbench.config.paths import GROUPS, POINT_GROUPS, choice_name, choices, default_choice, settings
from kvbench.core.checks import is_int
from kvbench.core.errors import KVBenchError
from kvbench.engine.config import PREFILL_ATTENTION, check_sampling
from kvbench.models import LoadedModel, declared_max_positions


def validate(cfg: DictConfig) -> None:
    """Every top-level, engine and generic task setting, before anything runs: one line naming the setting and
    what it accepts. (Method parameters are checked where the method is built; model ones where it loads.)"""
    if cfg.get("claims"):
        raise KVBenchError(f"this experiment is a claims preset (it measures {', '.join(cfg.claims)}, it runs no "
                           "method): run it with `python -m kvbench analyze experiment=NAME`")
    budget, ratio = cfg.budget, cfg.get("compression_ratio")
    if ratio is not None:
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio < 1:
            raise KVBenchError(f"compression_ratio must be a fraction of the tokens removed in [0, 1) (kvpress's "
                               f"convention), got {ratio!r}")
    elif isinstance(budget, bool) or not isinstance(budget, (int, float)) or budget <= 0:
        raise KVBenchError(f"budget must be a positive number of tokens per KV head (or a ratio in (0, 1)), got {budget!r}")
    elif isinstance(budget, float) and budget >= 1 and not budget.is_integer():
        raise KVBenchError(f"budget {budget} is neither a token count nor a ratio in (0, 1)")
    elif budget == 1.0 and isinstance(budget, float):  # a ratio of 1 or one token: say which, run neither
        raise KVBenchError("budget=1.0 is ambiguous: write budget=1 for one token per KV head; to keep everything "
                           "use method=full (or any budget at or above the context length)")
    check_shared_settings(cfg)
    if not isinstance(cfg.compress_question, bool):
        raise KVBenchError(f"compress_question must be true or false, got {cfg.compress_question!r}")
    engine = cfg.engine
    for key, low in (("snapshot_window", 1), ("snapshot_cache_mb", 0)):
        if key in engine and (not is_int(engine[key]) or engine[key] < low):
            raise KVBenchError(f"engine.{key} must be an integer >= {low}, got {engine[key]!r}")
    for key in ("sample_batch", "batch_rows"):
        if key in engine and (not is_int(engine[key]) or engine[key] < 1):
            raise KVBenchError(f"engine.{key} must be a positive integer, got {engine[key]!r}")
    if "row_block" in engine and engine.row_block != "auto" and (not is_int(engine.row_block) or engine.row_block < 1):
        raise KVBenchError(f"engine.row_block must be auto or a positive integer, got {engine.row_block!r}")
    if "compile" in engine and engine.compile not in ("auto", True, False):
        raise KVBenchError(f"engine.compile must be auto, true or false, got {engine.compile!r}")
    check_prefill_attention(engine)
    if not isinstance(cfg.get("profile", False), bool):  # `profile=maybe` was a profiled point (any text is true)
        raise KVBenchError(f"profile must be true or false, got {cfg.profile!r}")
    profiler = cfg.get("profiler") or {}
    if "repeats" in profiler and (not is_int(profiler.repeats) or profiler.repeats < 1):
        raise KVBenchError(f"profiler.repeats must be a positive integer, got {profiler.repeats!r}")
    if "warmup_steps" in profiler and (not is_int(profiler.warmup_steps) or profiler.warmup_steps < 0):
        raise KVBenchError(f"profiler.warmup_steps must be an integer >= 0, got {profiler.warmup_steps!r}")
    if "stages" in profiler and not isinstance(profiler.stages, bool):
        raise KVBenchError(f"profiler.stages must be true or false, got {profiler.stages!r}")
    if profiler.get("stages") and not cfg.get("profile"):
        raise KVBenchError("profiler.stages=true times the stages of a profiled run: add profile=true")
    check_sampling(engine, cfg.task)  # engine.sampling, and no batched rows for a point that samples
    num_samples = cfg.task.get("num_samples")
    if num_samples is not None and (not is_int(num_samples) or num_samples < 1):
        raise KVBenchError(f"task.num_samples must be a positive integer (or null for every sample where the task "
                           f"allows it), got {num_samples!r}")
    seq_len = cfg.task.get("seq_len")
    if seq_len is not None and (not is_int(seq_len) or seq_len < 1):
        raise KVBenchError(f"task.seq_len must be a positive number of tokens, got {seq_len!r}")
    max_new_tokens = cfg.task.get("max_new_tokens")  # null: the task's own limit, where it has one
    if max_new_tokens is not None and (not is_int(max_new_tokens) or max_new_tokens < 1):
        raise KVBenchError(f"task.max_new_tokens must be a positive number of tokens, got {max_new_tokens!r}")


def check_shared_settings(cfg: DictConfig) -> None:
    """The settings a run shares with `kvbench analyze`: the seed, the progress bars, and the engine's flags and
    system prompt (where its config has them)."""
    if not is_int(cfg.seed) or not 0 <= cfg.seed < 2**32:  # numpy's and torch's seeds are unsigned 32-bit words
        raise KVBenchError(f"seed must be an integer from 0 to 2**32 - 1, got {cfg.seed!r}")
    if not isinstance(cfg.show_progress, bool):
        raise KVBenchError(f"show_progress must be true or false, got {cfg.show_progress!r}")
    engine = cfg.engine
    for key in ("reuse_prefill", "nll", "chat_template", "topk_recall"):
        if key in engine and not isinstance(engine[key], bool):
            raise KVBenchError(f"engine.{key} must be true or false, got {engine[key]!r}")
    if engine.get("system_prompt") is not None and not isinstance(engine.system_prompt, str):
        raise KVBenchError(f"engine.system_prompt must be text or null, got {engine.system_prompt!r}")


def check_length(cfg: DictConfig, lm: "LoadedModel | None" = None) -> None:
    """A task longer than the model allows: say how long this model goes and the ways out. Without `lm` (before
    the model loads), against the limit its configs declare (`kvbench.models.declared_max_positions`), where they
    can be read without loading it."""
    seq_len = cfg.task.get("seq_len")
    if not is_int(seq_len):
        return
    limit = lm.max_positions if lm is not None else declared_max_positions(cfg.model)
    name = lm.name if lm is not None else cfg.model.name
    if is_int(limit) and seq_len > limit:
        longer = next((f", or on a longer-context model (model={model}, {label})" for model, positions, label in
                       LONGER_MODELS if positions > limit), "")
        raise KVBenchError(
            f"task {cfg.task.name} asks for {seq_len} tokens (task.seq_len) but {name} allows at most "
            f"{limit} positions: run it with task.seq_len={limit} or less (e.g. "
            f"task=ruler_4k / ruler_8k, or task.seq_len=4096){longer}"
        )


# What a too-long task's error suggests, the first whose limit is over the refusing model's.
LONGER_MODELS = (("llama3.1_8b_instruct", 131072, "128K"), ("llama3_8b_instruct_gradient_1048k", 1048576, "1M"))


def check_group_overrides(argv: list[str]) -> None:
    """Name an unknown model/method/task/experiment in one line, before Hydra's search-path dump."""
    for arg in argv:
        key, sep, value = arg.lstrip("+~").partition("=")
        if not sep or key not in GROUPS:
            continue
        values = value.split(",") if "," in value and not value.startswith(("[", "choice(", "range(")) else [value]
        known = choices(key)
        for v in values:
            if v not in known:
                raise KVBenchError(f"unknown {key} {v!r}; available: {', '.join(known)}")


def check_settings(argv: list[str]) -> list[str]:
    """Name a `model.`, `method.` or `task.` setting that the chosen config lacks, in one line, and let
    `method.KEY=VALUE` set a parameter that several swept methods share.

    Hydra composes a sweep's base config with the default method (`full`), so a parameter it lacks
    (`-m method=snapkv,adakv method.pooling=avg`) would be refused before any job runs; `++method.KEY=VALUE`
    sets it in each job's method instead. With an experiment preset the chosen configs come from the preset,
    so the check is left to the jobs (a method then names an unknown parameter when it is built).
    """
    chosen: dict[str, list[str]] = {}
    for arg in argv:
        key, sep, value = arg.lstrip("+").partition("=")
        if key in POINT_GROUPS and sep:
            chosen[key] = value.split(",") if "," in value and not value.startswith(("[", "choice(")) else [value]
    preset = any(arg.lstrip("+").startswith("experiment=") for arg in argv)
    out = []
    for arg in argv:
        key = arg.split("=", 1)[0]
        group, _, setting = key.partition(".")
        if "=" in arg and group in POINT_GROUPS and setting and not preset:
            for name in chosen.get(group, [default_choice(group)]):
                if group == "method" and not compresses(name):
                    if setting.split(".")[0] in any_method_setting():
                        continue  # `full` ignores a setting a sweep shares (kvbench.methods.method_parameters)
                    raise KVBenchError(f"{key} is not a setting of any method (method {name} has none: "
                                       "python -m kvbench --help lists the methods; conf/method/ their settings)")
                known = settings(group, name)
                if setting.split(".")[0] not in known:
                    close = difflib.get_close_matches(setting.split(".")[0], known, n=1)
                    hint = f"did you mean {group}.{close[0]}? " if close else ""
                    raise KVBenchError(f"{key} is not a setting of {group} {name} ({hint}its settings: "
                                       f"{', '.join(known) or 'none'}); set it only where it exists")
        out.append("++" + arg if group == "method" and setting and "=" in arg and not arg.startswith(("+", "~"))
                   else arg)
    return out


@functools.cache
def any_method_setting() -> frozenset[str]:
    """Every setting of every method config: what `method.KEY` may name beside `full`, which has none."""
    return frozenset(key for name in choices("method") for key in settings("method", name))


def compresses(method_choice: str) -> bool:
    """Whether a method config's method can change a result through its budget and settings (not `full`)."""
    from kvbench.methods import METHODS

    method = METHODS.get(choice_name("method", method_choice))
    return method is None or method.uses_budget



def check_prefill_attention(engine: DictConfig) -> None:
    """`engine.prefill_attention` is dense or minference; MInference's settings are checked where they are read
    (`MInference.from_settings`)."""
    kind = engine.get("prefill_attention", "dense")
    if kind not in PREFILL_ATTENTION:
        raise KVBenchError(f"engine.prefill_attention must be one of {', '.join(PREFILL_ATTENTION)}, got {kind!r}")
    if kind == "minference":
        from kvbench.attention.minference import MInference

        MInference.from_settings(dict(engine.get("minference") or {}))
