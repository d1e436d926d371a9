"""RocketKV (Behnam et al., "RocketKV: Accelerating Long-Context LLM Inference via Two-Stage KV Cache
Compression", ICML 2025, arXiv:2502.14051, §3): SnapKV eviction at the end of prefill, then hybrid sparse
attention (HSA) at every decode step. Compared with the release (NVlabs/RocketKV) in docs/fidelity.md.

The budget t is per KV group and per decode step, traffic of the HSA estimate included. With S = prompt +
tokens to generate (capped at the model's limit) and c = S / t, the adaptive decomposition gives stage 1
compression c^r and stage 2 the rest, r = min(0.2 + 0.06 log2 c, 0.8) (`split` fixes r for the paper's
ablation). The arithmetic is the authors' accuracy path (`infllm_utils.compress`):

    cap = max(int(S / c^r), min(2 * new_tokens, S));  prompt_budget = cap - new_tokens
    k2 = t // 2;  c2 = max(1, cap / t);  p = ceil(sqrt(c2)) (1 if > c2);  k1 = int(D * p / c2)

Stage 1: GQA-aware SnapKV keeps `prompt_budget` tokens per KV head, window included (window 32, max-pool
kernel 63 over window-mean, group-mean scores; the code's sums rank identically; 128-token window for SCBench).
Stage 2: HSA (`kvbench.methods.hsa`) over the survivors and the generated tokens, pages built over the
compressed cache and updated as tokens are appended.

As in the released code, the prompt's last token is not prefilled: it goes through the decode path, so the
observation window is the end of prompt[:-1] and the first answer token already comes from HSA
(`last_prompt_token_via_decode`). `skip_layers`, the released configs' name (LongChat: 2), keeps the first layers
dense like `dense_layers`.
Multi-turn: every later turn's input attends to the compressed past and SnapKV re-compresses past + input
to `prompt_budget` (the `turn_end` event); `rocketkv_mt` keeps the full history instead. A budget at or
above S is full attention (the default short-circuit).

`scoring_dtype` (kvbench.methods.common.arithmetic): HSA's estimate in float32 (null) or, with `release`, in
float16 as the release's model is (`kvbench.methods.hsa`); the SnapKV stage's scores stay float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvbench.core.contract import Plan
from kvbench.methods.base import EvictionMethod, SelectionMethod, register_method
from kvbench.methods.common.arithmetic import check_scoring_dtype, scoring_dtype
from kvbench.methods.hsa import HSAStage, hsa_parameters
from kvbench.methods.snapkv import SnapKV


def rocket_plan(sequence_length: int, budget: int, head_dim: int, new_tokens: int, split: float | None = None) -> dict:
    """RocketKV's per-sample parameters (the accuracy path's arithmetic, `infllm_utils.compress`)."""
    c = max(1.0, sequence_length / budget)
    r = min(0.2 + 0.06 * math.log2(c), 0.8) if split is None else split
    cap = int(sequence_length / c**r)
    cap = max(cap, min(2 * new_tokens, sequence_length))
    stage2 = hsa_parameters(cap / budget, head_dim)
    return {"c": c, "r": r, "capacity": cap, "prompt_budget": cap - new_tokens, "c2": max(1.0, cap / budget),
            "page_size": stage2["page_size"], "k1": stage2["k1"], "k2": budget // 2}


@register_method
@dataclass
class RocketKV(EvictionMethod, SelectionMethod):
    """Two stages: `eviction`, a GQA-aware SnapKV, and `selection`, HSA. The fields stay flat (the YAML's);
    `window`, `kernel`, `pooling`, `gqa_agg` and `granularity` are the SnapKV stage's and are checked there."""

    name = "rocketkv"
    family = "two-stage"
    static_selection = True
    evicts_every_turn: ClassVar[bool] = True
    window: int = 32
    kernel: int = 63
    pooling: str = "max"
    gqa_agg: str = "mean"
    granularity: str | None = None
    split: float | None = None  # null: the adaptive r; 0.3 / 0.5 / 0.7 for the static-r ablation
    skip_layers: int = 0
    last_prompt_token_via_decode: bool = True
    scoring_dtype: str | None = None  # null/float32 | release: HSA's estimate in float16, as the release

    def __post_init__(self) -> None:
        super().__post_init__()
        self.eviction = SnapKV(window=self.window, kernel=self.kernel, pooling=self.pooling, gqa_agg=self.gqa_agg,
                               granularity=self.granularity)
        self.granularity = self.eviction.granularity
        if self.split is not None and not 0 < self.split < 1:
            raise ValueError(f"split (the static r) must be in (0, 1) or null for the adaptive one, got {self.split!r}")
        if self.skip_layers < 0:
            raise ValueError(f"skip_layers must be a number of layers >= 0, got {self.skip_layers!r}")
        if self.granularity != "group":
            raise ValueError("rocketkv's stage 1 is GQA-aware: granularity must be group")
        check_scoring_dtype(self.scoring_dtype)
        self.selection = HSAStage(scoring_dtype(self.scoring_dtype, torch.float16))

    @property
    def obs_window(self) -> int:
        return self.window

    def plan(self, budget, *, sequence_length, new_tokens, head_dim, num_layers=None):
        if budget >= sequence_length:
            return Plan.full_attention()
        derived = rocket_plan(sequence_length, budget, head_dim, new_tokens, self.split)
        return Plan(evict=derived["prompt_budget"], select=budget, derived=derived)

    def is_dense_layer(self, layer_idx: int) -> bool:
        return layer_idx < self.skip_layers or super().is_dense_layer(layer_idx)

    def keep(self, layer, budget, step):
        return self.eviction.keep(layer, budget, step)

    def build_derived(self, layer, step):
        return self.selection.build_derived(layer, step)

    def select(self, layer, q, view, step, scaling):
        return self.selection.select(layer, q, step)

    def step_traffic(self, layer, selection, step):
        if selection is None:
            return super().step_traffic(layer, None, step)
        return self.selection.traffic(layer, selection, step)
