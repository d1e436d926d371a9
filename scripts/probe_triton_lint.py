"""Issue 45 device probe: the graph lint's verdicts (`kvbench.devtools.graph_lint`) against inductor's and Triton's on a
CUDA device, on six small graphs, and the fallback of a Quest step built on the old `descending_keys` (which
Triton refuses) to eager with one warning line. Run from the repository root, on a GPU machine:

    python scripts/probe_triton_lint.py

On CPU it runs too (inductor's C++ backend accepts every case: the lint's verdicts then stand alone).
"""
import inspect
import logging
import os
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

import kvbench.kernels.stable_topk as stable_topk
from kvbench.devtools import static_decode
from kvbench.devtools.graph_lint import lint_backend
from kvbench.engine.compiled import CompiledDecoder, describe
from kvbench.methods import build_method
from kvbench.models import load_model


def old_keys(scores: torch.Tensor) -> torch.Tensor:
    """`descending_keys` before the fix: the index reversed from 2^32 - 1, which Triton refuses in int32."""
    length = scores.shape[-1]
    bits = (scores.float() + 0.0).view(torch.int32)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    reversed_index = (1 << 32) - 1 - torch.arange(length, device=scores.device)
    return (ordered.to(torch.int64) << 32) | reversed_index


CASES = {
    "old descending_keys + topk": lambda s: old_keys(s).topk(5, dim=-1).indices,
    "new descending_keys + topk": lambda s: stable_topk.descending_keys(s).topk(5, dim=-1).indices,
    "where(mask, |arange-32|, int64 max)": lambda s: torch.where(
        s > 0, (torch.arange(s.shape[-1], device=s.device) - 32).abs()[None], torch.iinfo(torch.int64).max),
    "where(mask, int64 max, 68)": lambda s: torch.where(s > 0, torch.iinfo(torch.int64).max, 68),
    "int64 values + 2**40": lambda s: s.to(torch.int64) + (1 << 40),
    "arange from 2**32": lambda s: s + torch.arange(1 << 32, (1 << 32) + s.shape[-1], device=s.device),
}


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="WARNING-LINE %(message)s")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        import triton
        tv = triton.__version__
    except Exception as exc:  # noqa: BLE001
        tv = f"none ({exc})"
    print("torch", torch.__version__, "triton", tv, "device", device,
          torch.cuda.get_device_name() if device == "cuda" else "")
    print("torch.compile", inspect.signature(torch.compile))
    print("has skip_guard_on_all_nn_modules_unsafe", hasattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe"))
    s = torch.randn(3, 300, device=device)
    for name, fn in CASES.items():
        verdicts = []
        for backend in (lint_backend(), "inductor"):
            torch._dynamo.reset()
            start = time.perf_counter()
            try:
                torch.compile(fn, backend=backend, fullgraph=True)(s)
                verdicts.append("ok")
            except Exception as exc:  # noqa: BLE001
                verdicts.append("REFUSED " + describe(exc)[:200])
            verdicts[-1] += f" ({time.perf_counter() - start:.1f}s)"
        print(f"CASE {name}\n  lint:     {verdicts[0]}\n  inductor: {verdicts[1]}")

    cfg = OmegaConf.load(Path(__file__).resolve().parents[1] / "kvbench" / "conf" / "model" / "tiny_llama.yaml")
    cfg.device = device
    lm = load_model(cfg)
    ids = static_decode.prompt(300, seed=1)
    _, eager_tokens, _ = static_decode.decode(lm, build_method("quest"), 64, ids, 4, None)
    stable_topk.descending_keys = old_keys
    os.environ["KVBENCH_KERNELS"] = "torch"  # the PyTorch top-k, traced by inductor (CUDA's is the kvbench::stable_topk kernel)
    torch._dynamo.reset()
    start = time.perf_counter()
    session, tokens, _ = static_decode.decode(lm, build_method("quest"), 64, ids, 4, CompiledDecoder(lm, "inductor"))
    print(f"OLD-KEYS QUEST STEP on {device} inductor: path={session.decode_path} reason={session.decode_path_reason!r} "
          f"tokens_equal={tokens == eager_tokens} ({time.perf_counter() - start:.1f}s)")


if __name__ == "__main__":
    main()
