"""Engine settings: the knobs of one sample's run that the `engine:` config group sets."""

from __future__ import annotations

from dataclasses import dataclass


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
