"""One sample, end to end: prompt, prefill, compression, greedy decode, teacher-forced NLL, the record."""

from kvbench.core.budget import CompressionRatio, resolve_budget
from kvbench.engine.config import EngineConfig
from kvbench.engine.prompt import PromptBuilder
from kvbench.engine.sample import run_group, run_sample
from kvbench.engine.session import Session, decode_batch, step_batch, teacher_forced_nll_batch

__all__ = ["CompressionRatio", "EngineConfig", "PromptBuilder", "Session", "decode_batch", "resolve_budget",
           "run_group", "run_sample", "step_batch", "teacher_forced_nll_batch"]
