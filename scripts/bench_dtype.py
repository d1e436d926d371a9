"""bfloat16 vs float32 on this CPU: prefill time and decode time per token of the embedded model.

    python scripts/bench_dtype.py [--length 2048] [--steps 16]

Prints whether this CPU multiplies bfloat16 natively (oneDNN: AMX or AVX512-BF16; `model.dtype=auto` picks
bfloat16 exactly then), the times per dtype (best of `--repeats` prefills, median decode step through the
engine's `Session`) and the ratios fp32 / bf16.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from kvbench.engine.session import Session
from kvbench.methods import build_method
from kvbench.models import fast_cpu_bfloat16, load_model

CONF = Path(__file__).resolve().parents[1] / "kvbench" / "conf" / "model"


def measure(dtype: str, args: argparse.Namespace) -> tuple[float, float]:
    cfg = OmegaConf.load(CONF / f"{args.model}.yaml")
    cfg.dtype, cfg.device = dtype, "cpu"
    lm = load_model(cfg)
    ids = torch.randint(100, lm.model.config.vocab_size - 100, (args.length,),
                        generator=torch.Generator().manual_seed(0)).tolist()
    prefill = []
    for _ in range(args.repeats):
        session = Session(lm, build_method("full"), None)
        start = time.perf_counter()
        logits, _ = session.prefill(ids, compress=False)
        prefill.append(time.perf_counter() - start)
    steps = []
    token = int(logits.argmax())
    for i in range(args.steps + 2):
        start = time.perf_counter()
        logits = session.step(token)
        if i >= 2:
            steps.append(1e3 * (time.perf_counter() - start))
        token = int(logits.argmax())
    return min(prefill), statistics.median(steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2_135m")
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"native bfloat16 matmuls on this CPU: {fast_cpu_bfloat16()} ({torch.get_num_threads()} threads); "
          f"{args.model}, {args.length}-token prompt")
    results = {dtype: measure(dtype, args) for dtype in ("float32", "bfloat16")}
    for dtype, (prefill, step) in results.items():
        print(f"{dtype:<9} prefill {prefill:7.2f} s   decode {step:6.1f} ms/token")
    (p32, d32), (p16, d16) = results["float32"], results["bfloat16"]
    print(f"fp32 / bf16: prefill {p32 / p16:.2f}x, decode {d32 / d16:.2f}x")


if __name__ == "__main__":
    main()
