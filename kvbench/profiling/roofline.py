"""Roofline ratios: what a phase achieved against what this machine can do.

Costs come from the model config and the records: prefill is compute-bound (FLOPs of the dense layers plus
causal attention over the prompt), decode is bandwidth-bound (bytes of the weights plus the K/V elements the
method's own cost model says one step reads, `decode_read_bytes_per_step`). The machine's peaks come from a
one-time micro-benchmark (`machine_peaks`: matmul throughput per dtype and copy bandwidth), cached per
machine under $KVBENCH_CACHE/roofline/. Reports show achieved / peak: compute utilisation for prefill,
bandwidth utilisation for decode.
"""

from __future__ import annotations

import json
import platform
import time
from typing import Any

import torch

from kvbench.core.devices import DTYPES, sync
from kvbench.models import cache_root


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"




def best_seconds(fn, device: torch.device, repeats: int = 5) -> float:
    """The fastest of `repeats` timed calls of `fn`, after one untimed call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def measure_peaks(device: torch.device) -> dict[str, Any]:
    """Matmul TFLOP/s per dtype (square matmuls, best of 5) and memory bandwidth in GB/s (a large copy:
    bytes read plus bytes written)."""
    n = 4096 if device.type == "cuda" else 1024
    peaks: dict[str, Any] = {"matmul_tflops": {}}
    for name, dtype in DTYPES.items():
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        seconds = best_seconds(lambda: torch.mm(a, b), device)
        peaks["matmul_tflops"][name] = 2 * n**3 / seconds / 1e12
    elements = (1 << 28 if device.type == "cuda" else 1 << 26) // 4  # 256 MiB (GPU) / 64 MiB (CPU) of fp32
    src = torch.ones(elements, device=device)
    dst = torch.empty_like(src)
    seconds = best_seconds(lambda: dst.copy_(src), device)
    peaks["bandwidth_gbps"] = 2 * src.numel() * 4 / seconds / 1e9
    return peaks


def machine_peaks(device: torch.device) -> dict[str, Any]:
    """`measure_peaks` for this machine and device, measured once and cached."""
    key = "-".join([platform.node(), _device_name(device), torch.__version__, str(torch.get_num_threads())])
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in key)
    path = cache_root() / "roofline" / f"{safe}.json"
    if path.is_file():
        return json.loads(path.read_text())
    peaks = {"device": _device_name(device), "threads": torch.get_num_threads(), **measure_peaks(device)}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(peaks, indent=1))
    return peaks


def phase_costs(config: Any, prompt_tokens: int, decode_read_bytes_per_step: float | None,
                dtype_bytes: int, weight_bytes: float | None = None) -> dict[str, float]:
    """FLOPs of the prefill and bytes one decode step moves, from the model config and the method's reads.

    Dense layers: 2 FLOPs per parameter per token (embeddings excluded, the LM head counted once per prefill:
    only the last position's logits are computed). Causal attention: QK^T and PV over half the L x L square,
    2 * 2 * L^2 / 2 * heads * head_dim per layer. Decode bytes: every weight once, plus what the method reads;
    the weights' bytes from the config at `dtype_bytes` each, or `weight_bytes` where the stored weights are
    counted instead (quantised weights: `decode_weight_bytes`).
    """
    layers, hidden = config.num_hidden_layers, config.hidden_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = config.num_key_value_heads
    inter = config.intermediate_size
    per_layer = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * inter
    body = layers * per_layer
    head = config.vocab_size * hidden
    prefill_flops = 2 * body * prompt_tokens + 2 * head + 2 * layers * prompt_tokens**2 * heads * head_dim
    if weight_bytes is None:
        weight_bytes = (body + head) * dtype_bytes
    return {
        "prefill_flops": float(prefill_flops),
        "decode_bytes_per_step": float(weight_bytes + (decode_read_bytes_per_step or 0.0)),
    }


def decode_weight_bytes(lm: Any) -> int:
    """The weight bytes one decode step reads, as stored: every parameter (a quantised weight at its packed size
    plus its quantisation state: `LoadedModel.weight_bytes_by_device`) but the input embedding table, of which a
    step reads one row; a table tied to the output head is counted, since the head reads it whole."""
    total = sum(lm.weight_bytes_by_device().values())
    embedding = lm.model.get_input_embeddings().weight
    head = lm.model.get_output_embeddings()
    if head is None or head.weight is not embedding:
        total -= embedding.numel() * embedding.element_size()
    return total


def roofline(record: dict[str, Any], config: Any, dtype: str, peaks: dict[str, Any],
             weight_bytes: float | None = None) -> dict[str, Any] | None:
    """Achieved and peak rates of one profiled record (None without a profile); `weight_bytes`: the weights a
    decode step reads, where the config's count at the dtype's size would be wrong (quantised weights)."""
    profile = record.get("profile")
    if not profile or record.get("oom"):
        return None
    costs = phase_costs(config, record["prompt_tokens"], record.get("decode_read_bytes_per_step"),
                        DTYPES[dtype].itemsize, weight_bytes)
    out: dict[str, Any] = dict(costs)
    peak_tflops = peaks["matmul_tflops"][dtype]
    if profile.get("prefill_s"):
        achieved = costs["prefill_flops"] / profile["prefill_s"] / 1e12
        out.update(prefill_tflops=achieved, peak_tflops=peak_tflops, prefill_compute_util=achieved / peak_tflops)
    if profile.get("decode_ms_median"):
        achieved = costs["decode_bytes_per_step"] / (profile["decode_ms_median"] / 1e3) / 1e9
        out.update(decode_gbps=achieved, peak_gbps=peaks["bandwidth_gbps"],
                   decode_bandwidth_util=achieved / peaks["bandwidth_gbps"])
    return out
