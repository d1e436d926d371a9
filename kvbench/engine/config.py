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
    # rows of a group (a sample's sweep points, or `sample_batch` samples) decoded in one forward at most; 1 = one
    # row at a time. Records do not depend on it: eager decode forwards are padded to `row_block` rows, and a
    # probe checks that this machine's kernels then give a row the same bits in any batch
    # (kvbench.engine.invariance), else the rows decode one at a time and the records say why
    batch_rows: int = 16
    # the fewest rows an eager decode forward's dense layers multiply (a lone row padded): auto = 4 on CPU (x86
    # BLAS switches float32 products of 1-3 rows to a matrix-vector path that rounds otherwise), `batch_rows` on
    # CUDA (one product shape for every forward, which the weights' bytes bound anyway). 1 = stock's lone row
    row_block: "str | int" = "auto"
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

    def resolved_row_block(self, device: Any) -> int:
        """`row_block` for a model on `device` (a `torch.device`)."""
        if self.row_block == "auto":
            return max(1, int(self.batch_rows)) if getattr(device, "type", "cpu") == "cuda" else 4
        return int(self.row_block)

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
    """`engine.sampling` is auto or greedy. (A sampled point may decode in batched rows: each row draws from its
    own generator, and its logits are the same bits in any batch: `kvbench.engine.invariance`.)"""
    setting = engine.get("sampling", "auto")
    if setting not in SAMPLING_SETTINGS:
        raise KVBenchError(f"engine.sampling must be auto (the task's decoding protocol) or greedy, got {setting!r}")
