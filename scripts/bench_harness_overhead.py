"""The harness's own cost around the model: a full-cache point through kvbench vs the bare model loop.

    python scripts/bench_harness_overhead.py [--seq-len 2048] [--samples 3] [--model smollm2_135m]

kvbench: `run_sample` on RULER niah_single_1 samples with method `full` (prompt building, the cache and its
bookkeeping, greedy decoding, stop checks, scoring), once without and once with the teacher-forced NLL (extra
forward steps over the gold answer, an accuracy metric). Bare: the same prompt ids through the same model object
with transformers' DynamicCache and SDPA, then the same number of greedy steps; nothing else. The bare loop uses
the loaded model's own weights (on a bf16 CPU kvbench's blocked products, which a second stock copy could not
load), so the ratio is the harness's cost and not a difference in the products. Prints harness time / bare time.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from transformers import DynamicCache

from kvbench.engine.config import EngineConfig
from kvbench.engine.prompt import PromptBuilder
from kvbench.engine.sample import run_sample
from kvbench.methods import build_method
from kvbench.models import cache_kwargs, load_model

CONF = Path(__file__).resolve().parents[1] / "kvbench" / "conf"


@contextlib.contextmanager
def stock_attention(model) -> Iterator[None]:
    """The model with transformers' SDPA attention (and its masks) instead of kvbench's, for the bare loop."""
    previous = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


@torch.inference_mode()
def bare_generate(model, ids: list[int], new_tokens: int) -> float:
    start = time.perf_counter()
    cache = DynamicCache(config=model.config)
    out = model(input_ids=torch.tensor([ids]), **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
    token = out.logits[0, -1].argmax()
    for _ in range(new_tokens - 1):
        out = model(input_ids=token.view(1, 1), **cache_kwargs(model, cache), use_cache=True)
        token = out.logits[0, -1].argmax()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--model", default="smollm2_135m", help="a kvbench/conf/model name")
    parser.add_argument("--dtype", default=None, help="model.dtype (default: the model config's)")
    args = parser.parse_args(argv)
    model_cfg = OmegaConf.load(CONF / "model" / f"{args.model}.yaml")
    if args.dtype:
        model_cfg.dtype = args.dtype
    lm = load_model(model_cfg)
    task_cfg = OmegaConf.load(CONF / "task" / "ruler_niah_single_1.yaml")
    task_cfg.seq_len, task_cfg.num_samples = args.seq_len, args.samples
    task = instantiate(task_cfg, _convert_="all")
    task.max_positions = lm.max_positions
    builder = PromptBuilder(lm.tokenizer)
    samples = task.samples(builder.measure, seed=42)
    method = build_method("full")
    times = {"kvbench (no NLL)": 0.0, "kvbench (with NLL)": 0.0, "bare model": 0.0}
    for sample in samples:
        ids = sum(builder.first_turn(sample), [])
        record = run_sample(lm, method, 1024, sample, EngineConfig(reuse_prefill=False, nll=False))
        times["kvbench (no NLL)"] += record["wall_s"]
        times["kvbench (with NLL)"] += run_sample(lm, method, 1024, sample, EngineConfig(reuse_prefill=False))["wall_s"]
        with stock_attention(lm.model):
            times["bare model"] += bare_generate(lm.model, ids, record["new_tokens"])
    print(f"{lm.name}, {lm.dtype}, {len(samples)} RULER niah_single_1 samples of {args.seq_len} tokens, full cache")
    for name, seconds in times.items():
        print(f"{name:<20} {seconds:7.2f} s   {seconds / times['bare model']:.2f}x bare")


if __name__ == "__main__":
    main()
