"""How fast an eager PyTorch decode step of the model can be at all, without the harness, against the gemv floor.

    python scripts/bench_eager_floor.py                      # embedded SmolLM2, bf16 on this CPU, 256 cached rows
    python scripts/bench_eager_floor.py --dtype float32 --rows 8192

The step (`kvbench.bench.eager_floor.eager_step`) is written out by hand from the model's own modules
(embedding, norms, the packed projections, rotary embedding, MLP, output head) over a static cache of `--rows`
rows per KV head, written in place, with the one decode attention every method uses (`kernels.decode_attention`).
No cache object, no attention dispatcher, no method, no statistics: what remains is the model's operators in
eager mode. Printed: its ms per
token, the gemv floor of the bytes it reads (weights + K/V, at the rate `bench_decode_latency.py` measures),
and the ratio. `bench_decode_latency.py`'s ratio for a method with the same rows, over this one, is what the
harness and the method add.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
from omegaconf import OmegaConf

from kvbench.bench.eager_floor import time_eager_steps
from kvbench.bench.timing import gemv_bandwidth
from kvbench.models import load_model

CONF = Path(__file__).resolve().parents[1] / "kvbench" / "conf" / "model"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2_135m", help="a kvbench/conf/model name")
    parser.add_argument("--dtype", default="auto", help="auto, bfloat16 or float32")
    parser.add_argument("--rows", type=int, default=256, help="cached rows per KV head")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)

    cfg = OmegaConf.load(CONF / f"{args.model}.yaml")
    cfg.device, cfg.dtype = "cpu", args.dtype
    lm = load_model(cfg)
    times, ratios = time_eager_steps(lm, args.rows, args.steps, args.rounds, gemv_bandwidth)
    median, ratio = statistics.median(times), statistics.median(ratios)
    print(f"{lm.name}, {lm.dtype}, {torch.get_num_threads()} threads, {args.rows} cached rows per KV head: eager step "
          f"without the harness {median:.1f} ms/token, gemv floor {median / ratio:.1f} ms, ratio {ratio:.2f}")


if __name__ == "__main__":
    main()
