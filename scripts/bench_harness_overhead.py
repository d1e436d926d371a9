"""The harness's own cost around the model: a full-cache point through kvbench vs the bare model loop.

    python scripts/bench_harness_overhead.py [--seq-len 2048] [--samples 3] [--model smollm2_135m]

kvbench: `run_sample` on RULER niah_single_1 samples with method `full` (prompt building, the cache and its
bookkeeping, greedy decoding, stop checks, scoring), once without and once with the teacher-forced NLL (extra
forward steps over the gold answer, an accuracy metric). Bare: the same prompt ids through the model with
transformers' DynamicCache and SDPA, then the same number of greedy steps; nothing else. Prints the ratio
harness time / bare model time.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, DynamicCache

from kvbench.engine.config import EngineConfig
from kvbench.engine.prompt import PromptBuilder
from kvbench.engine.sample import run_sample
from kvbench.methods import build_method
from kvbench.models import cache_kwargs, load_model

CONF = Path(__file__).resolve().parents[1] / "kvbench" / "conf"


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
    args = parser.parse_args(argv)
    lm = load_model(OmegaConf.load(CONF / "model" / f"{args.model}.yaml"))
    bare_model = AutoModelForCausalLM.from_config(lm.model.config, dtype=lm.dtype, attn_implementation="sdpa")
    bare_model.load_state_dict(lm.model.state_dict())
    bare_model.eval()
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
        times["bare model"] += bare_generate(bare_model, ids, record["new_tokens"])
    print(f"{lm.name}, {lm.dtype}, {len(samples)} RULER niah_single_1 samples of {args.seq_len} tokens, full cache")
    for name, seconds in times.items():
        print(f"{name:<20} {seconds:7.2f} s   {seconds / times['bare model']:.2f}x bare")


if __name__ == "__main__":
    main()
