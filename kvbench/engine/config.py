"""Engine settings: the knobs of one sample's run that the `engine:` config group sets."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from kvbench.core.errors import KVBenchError
from kvbench.engine.decoding import SAMPLING_SETTINGS, protocol_samples


@dataclass
class EngineConfig:
    compress_question: bool = True
    seed: int = 0  # the run's seed (top-level `seed`): with each sample's id, the generator a method draws from
    reuse_prefill: bool = True
    snapshot_window: int = 128  # observation queries kept per layer in a reusable prefill snapshot
    snapshot_cache_mb: int = 2048
    nll: bool = True
    chat_template: bool = True  # apply the model's chat template where the sample asks for it
    system_prompt: str | None = None
    topk_recall: bool = True  # selection methods: measure top-k attention-mass recall at every decode step
    sample_batch: int = 1  # samples of one point run together (run_group)
    # rows of a group decoded in one forward. 1: each row alone, records bitwise those of a lone run. More:
    # faster, but CPU/GPU kernels round a batched row differently, so NLLs and (at near-ties) predictions
    # drift from a lone run's (bf16 SmolLM2: 3 of 104 greedy answers, NLLs by up to ~5%)
    batch_rows: int = 1
    # the compiled decode step (kvbench.engine.compiled): auto = on CUDA only, true = wherever the method allows,
    # false = never. The eager path stays the exact default on CPU; records say which path ran (`decode_path`)
    compile: "str | bool" = "auto"
    # how tokens are picked (kvbench.engine.decoding): auto = the task's protocol (greedy, or seeded sampling where
    # a sample's meta["sampling"] asks for it), greedy = argmax always (records say what was set aside)
    sampling: str = "auto"
    # the prompt's first forward: dense = the model's causal attention; minference = MInference's vertical-slash
    # sparse prefill (`kvbench.attention.minference`) with the `minference` settings
    prefill_attention: str = "dense"
    minference: dict[str, Any] = field(default_factory=dict)

    def prefill_key(self) -> tuple:
        """What a shared prefill snapshot depends on beyond the prompt: the prefill attention and its settings."""
        if self.prefill_attention == "dense":
            return ()
        return (self.prefill_attention, tuple(sorted(self.minference.items())))

    def prefill_attention_function(self) -> Any:
        """The `Step.prefill_attention` of this engine's sessions: None for dense, else the sparse prefill."""
        key = self.prefill_key()
        return _minference(key[1]) if key else None


PREFILL_ATTENTION = ("dense", "minference")


@functools.lru_cache(maxsize=8)
def _minference(settings: tuple) -> Any:
    from kvbench.attention.minference import MInference

    return MInference.from_settings(dict(settings))


def task_samples(task: Any) -> bool:
    """Whether a task's config asks to sample: a positive `temperature`, or a positive `<part>_temperature` (a
    suite one of whose subsets samples, e.g. InfiniteBench's En.Sum, `sum_temperature`). The convention every task
    whose samples carry `meta["sampling"]` keeps: the temperature there comes from such a config key."""
    keys = [key for key in task.keys() if key == "temperature" or str(key).endswith("_temperature")]
    return any(protocol_samples({"temperature": task.get(key)}) for key in keys)


def point_samples(engine: Any, task: Any) -> bool:
    """Whether a point decodes by the task's sampling protocol, from its config alone (its identity and checks
    need it before any sample exists): `engine.sampling` is auto (the default) and the task's config asks to
    sample (`task_samples`); the engine then samples every sample whose `meta["sampling"]` asks for it."""
    return engine.get("sampling", "auto") == "auto" and task_samples(task)


def check_sampling(engine: Any, task: Any) -> None:
    """`engine.sampling` is auto or greedy, and a sampled point is not decoded in batched rows: a batched row's
    logits round otherwise than a lone row's (`batch_rows`), so its draws would depend on which other points and
    samples happened to share its forward (a resumed sweep batches differently), not on its seed alone."""
    setting = engine.get("sampling", "auto")
    if setting not in SAMPLING_SETTINGS:
        raise KVBenchError(f"engine.sampling must be auto (the task's decoding protocol) or greedy, got {setting!r}")
    rows = engine.get("batch_rows", 1)
    if point_samples(engine, task) and rows != 1:
        raise KVBenchError(f"engine.batch_rows={rows} with sampled decoding (task {task.get('name')}'s protocol "
                           "samples): batched rows round differently from a lone row, so a sample's draws would "
                           "depend on its batch; use engine.batch_rows=1, or engine.sampling=greedy")
