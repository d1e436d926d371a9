"""Wall time of a method x budget grid: kvbench batched (the default), kvbench one row at a time, and NVIDIA kvpress,
same samples.

    python scripts/bench_sweep_throughput.py                       # the grid below, on the embedded SmolLM2
    python scripts/bench_sweep_throughput.py --kvpress-python /path/to/venv/bin/python

The grid (the sweep-throughput issue's): 8 RULER niah_single_2 samples of ~1.9K tokens, question-agnostic,
16 new tokens; full plus StreamingLLM, SnapKV and Ada-SnapKV at compression ratios 0.25/0.5/0.75/0.9 (13
points). kvbench runs as one multirun with its defaults (`hydra/launcher=grouped`, `engine.batch_rows=16`: per
sample one dense prefill, each point's compression, then the points' decode steps and teacher-forced NLL as the
rows of shared forwards) and again one row at a time (`engine.batch_rows=1`: each point's steps its own forwards,
still one shared prefill per prompt); the printed agreement counts the records of the two runs that are equal
(they all should be: `kvbench.engine.invariance`). kvpress runs its text-generation pipeline press by
press over the same contexts and questions, with the same model weights (the converted SmolLM2 in
$KVBENCH_CACHE) and dtype, when it is importable here or in the interpreter given by --kvpress-python
(kvpress 0.5 needs transformers < 5.3, kvbench 5.x: a second virtual environment). Every wall time includes
its process start and model load. Printed: the times, their ratios, and where kvbench's time goes.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hydra.utils import instantiate
from omegaconf import OmegaConf

from kvbench.engine.prompt import PromptBuilder
from kvbench.models import load_model

ROOT = Path(__file__).resolve().parents[1]
RATIOS = "0.25,0.5,0.75,0.9"
METHODS = "full,streamingllm,snapkv,adakv"

KVPRESS_RUNNER = r"""
import json, sys, time
start = time.perf_counter()
import torch
from transformers import pipeline
from kvpress import AdaKVPress, SnapKVPress, StreamingLLMPress
data, model_dir, dtype, new_tokens, ratios = json.load(open(sys.argv[1])), sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
pipe = pipeline("kv-press-text-generation", model=model_dir, device="cpu", dtype=getattr(torch, dtype))
presses = [None]
for ratio in map(float, ratios.split(",")):
    presses += [StreamingLLMPress(compression_ratio=ratio), SnapKVPress(compression_ratio=ratio),
                AdaKVPress(SnapKVPress(compression_ratio=ratio))]
loaded = time.perf_counter()
for press in presses:
    for sample in data:
        pipe(sample["context"], question=sample["question"], press=press, max_new_tokens=new_tokens)
print(json.dumps({"wall_s": time.perf_counter() - start, "load_s": loaded - start, "points": len(presses)}))
"""


def run_kvbench(results: Path, max_group: int, args: argparse.Namespace, batch_rows: int = 16) -> float:
    command = [sys.executable, "-m", "kvbench", "-m", "task=ruler_niah_single_2", f"task.seq_len={args.seq_len}",
               f"task.num_samples={args.samples}", f"+task.max_new_tokens={args.new_tokens}", "compress_question=false",
               f"method={METHODS}", f"compression_ratio={RATIOS}", f"results_dir={results}",
               f"hydra.launcher.max_group={max_group}", f"engine.batch_rows={batch_rows}", f"model.dtype={args.dtype}",
               "show_progress=false"]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        sys.exit(f"kvbench failed:\n{done.stderr[-3000:]}")
    return time.perf_counter() - start


def breakdown(results: Path) -> dict[str, float]:
    """Where a grouped run's time went, from its records: dense prefills (once per prompt: the records that did
    not reuse a snapshot), compression, decode steps (each record holds its share of the batched steps), and
    the rest of the samples' wall time (the question appended per point, the NLL, scoring, bookkeeping)."""
    records = [json.loads(line) for p in results.rglob("records.jsonl") for line in p.read_text().splitlines()]
    decode = sum((r["decode_ms_per_token"] or 0) * max(r["new_tokens"] - 1, 0) / 1e3 for r in records)
    dense = sum(r["prefill_s"] for r in records if not r["prefill_reused"])
    return {"points": len({r["point_hash"] for r in records}), "records": len(records), "dense_prefill_s": dense,
            "compress_s": sum(r["compress_s"] for r in records), "decode_s": decode,
            "sample_wall_s": sum(r["wall_s"] for r in records)}


def agreement(grouped: Path, ungrouped: Path) -> str:
    """How many (point, sample) records of the two runs have identical predictions, scores and NLLs, and how many
    rows shared the first run's forwards."""
    def load(root: Path) -> dict[tuple[str, str], dict]:
        return {(r["point_hash"], r["sample_id"]): r for p in root.rglob("records.jsonl")
                for r in map(json.loads, p.read_text().splitlines())}

    a, b = load(grouped), load(ungrouped)
    same = {key: ([t["prediction"] for t in a[key]["turns"]] == [t["prediction"] for t in b[key]["turns"]],
                  a[key]["score"] == b[key]["score"], a[key]["nll"] == b[key]["nll"]) for key in a.keys() & b.keys()}
    rows = sorted(r.get("decode_batched_rows", 1) for r in a.values())
    return (f"batched vs one row at a time: {len(same)} of {len(a)} / {len(b)} records matched; identical "
            f"predictions {sum(s[0] for s in same.values())}, scores {sum(s[1] for s in same.values())}, NLLs "
            f"{sum(s[2] for s in same.values())}; rows sharing a forward (batched run) {rows[0]}-{rows[-1]}")


def kvpress_python(args: argparse.Namespace) -> str | None:
    if args.kvpress_python:
        return args.kvpress_python
    return sys.executable if importlib.util.find_spec("kvpress") else None


def run_kvpress(python: str, args: argparse.Namespace, work: Path) -> dict:
    model_cfg = OmegaConf.load(ROOT / "kvbench" / "conf" / "model" / "smollm2_135m.yaml")
    model_cfg.dtype = args.dtype
    lm = load_model(model_cfg)
    task_cfg = OmegaConf.load(ROOT / "kvbench" / "conf" / "task" / "ruler_niah_single_2.yaml")
    task_cfg.seq_len, task_cfg.num_samples = args.seq_len, args.samples
    task = instantiate(task_cfg, _convert_="all")
    task.max_positions = lm.max_positions
    samples = task.samples(PromptBuilder(lm.tokenizer).measure, seed=42)
    data = [{"context": s.context, "question": s.turns[0].question} for s in samples]
    (work / "samples.json").write_text(json.dumps(data))
    model_dir = Path(lm.model.name_or_path)  # the converted HF directory of the embedded model
    dtype = str(lm.dtype).replace("torch.", "")
    done = subprocess.run([python, "-c", KVPRESS_RUNNER, str(work / "samples.json"), str(model_dir), dtype,
                           str(args.new_tokens), RATIOS], capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"kvpress failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--kvpress-python", default=None)
    parser.add_argument("--dtype", default="auto", help="model.dtype for both (auto: bfloat16 where native)")
    parser.add_argument("--skip-one-row", action="store_true", help="skip the run one row at a time")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        times = {"kvbench batched": run_kvbench(work / "batched", 32, args)}
        grouped = breakdown(work / "batched")
        agree = None
        if not args.skip_one_row:
            times["kvbench one row"] = run_kvbench(work / "one_row", 32, args, batch_rows=1)
            agree = agreement(work / "batched", work / "one_row")
        python = kvpress_python(args)
        if python:
            times["kvpress"] = run_kvpress(python, args, work)["wall_s"]
        else:
            print("kvpress: not importable here and no --kvpress-python given; skipped")
    print(f"grid: {grouped['points']} points x {args.samples} samples of RULER niah_single_2 at {args.seq_len} "
          f"tokens, question-agnostic, {args.new_tokens} new tokens, model.dtype={args.dtype}")
    reference = times.get("kvpress")
    for name, seconds in times.items():
        ratio = f"   kvpress / this: {reference / seconds:5.2f}x" if reference else ""
        print(f"{name:<18} {seconds:8.1f} s{ratio}")
    if agree:
        print(f"one row at a time / batched: {times['kvbench one row'] / times['kvbench batched']:.2f}x; {agree}")
    g = grouped
    other = g["sample_wall_s"] - g["dense_prefill_s"] - g["compress_s"] - g["decode_s"]
    print(f"kvbench batched, where the time goes: dense prefill (one per prompt) {g['dense_prefill_s']:.1f} s, "
          f"compression {g['compress_s']:.1f} s, batched decode {g['decode_s']:.1f} s, question appends + NLL + "
          f"scoring + bookkeeping {other:.1f} s, process start + model load + sample building "
          f"{times['kvbench batched'] - g['sample_wall_s']:.1f} s")


if __name__ == "__main__":
    main()
