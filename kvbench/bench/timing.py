"""How long a callable or a decode step takes, and how fast this device reads memory.

The read rates are the floors the scripts' ratios divide by: `copy_gbps` (a large device-to-device copy, bytes
read plus written, as `kvbench.profiling.roofline.measure_peaks` measures it), `stream_bandwidth` (a STREAM-style
`torch.sum` pass) and `gemv_bandwidth` (the model's own weight products on one token).

Only `kvbench.core` is imported with this module: the roofline and the models import kvbench's Triton kernels,
which read `TRITON_INTERPRET` when imported, and a script sets it after its imports (a CPU smoke run).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from kvbench.core.devices import sync


def timed(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """Median seconds of `fn()`: replayed as one CUDA graph on a GPU (after warm-up), called plainly on CPU."""
    for _ in range(2):
        fn()
    sync(device)
    if device.type == "cuda":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        run = graph.replay
    else:
        run = fn
    times = []
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        run()
        sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def copy_gbps(device: torch.device) -> float:
    """GB/s of the fastest of five copies of a large buffer (256 MiB on a GPU, 64 MiB on a CPU; bytes read plus
    bytes written): `kvbench.profiling.roofline.measure_peaks`' copy without its matmuls."""
    from kvbench.profiling.roofline import best_seconds

    src = torch.ones((1 << 28 if device.type == "cuda" else 1 << 26) // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / best_seconds(lambda: dst.copy_(src), device) / 1e9


def stream_bandwidth(dtype: torch.dtype, nbytes: int = 1 << 29) -> float:
    """Bytes/s of the fastest `torch.sum` pass over an `nbytes` buffer of `dtype` (far larger than the caches)."""
    from kvbench.profiling.roofline import best_seconds

    buf = torch.ones(nbytes // torch.finfo(dtype).bits * 8, dtype=dtype)
    return buf.numel() * buf.element_size() / best_seconds(buf.sum, buf.device)


def gemv_bandwidth(model: torch.nn.Module) -> float:
    """Bytes/s at which the model's own weight products (`kvbench.models.weight_products`: its linear layers,
    the packed q/k/v and gate/up projections), run back to back on one token, stream their weights."""
    from kvbench.models import weight_products
    from kvbench.profiling.roofline import best_seconds

    products = weight_products(model)
    nbytes = sum(size for _, size in products)
    inputs = {m.in_features: torch.ones(1, 1, m.in_features, dtype=model.dtype, device=model.device)
              for m, _ in products}

    def all_products() -> None:
        for m, _ in products:
            m(inputs[m.in_features])

    with torch.inference_mode():
        return nbytes / best_seconds(all_products, model.device)


def time_decode(lm, session, logits: torch.Tensor, warmup: int, steps: int) -> tuple[list[float], torch.Tensor]:
    """ms of each of `steps` greedy decode steps through `Session.step` after `warmup` untimed ones, and the
    last logits (the next round continues from them)."""
    times = []
    token = int(logits.argmax())
    for step in range(warmup + steps):
        sync(lm.device)
        t0 = time.perf_counter()
        logits = session.step(token)
        sync(lm.device)
        if step >= warmup:
            times.append(1e3 * (time.perf_counter() - t0))
        token = int(logits.argmax())
    return times, logits


def step_read_bytes(session, dtype_bytes: int) -> float:
    """Bytes of K/V and auxiliary elements one decode step of `session` read (its method's cost model, summed by
    the cache's `DecodeStats`), plus the keys a method that scores every key reads to choose (`scored_keys`)."""
    stats, layers = session.cache.stats, session.cache.layers
    steps = stats.layer_steps / len(layers)
    per_row = 2 * layers[0].head_dim * layers[0].num_heads * len(layers) * dtype_bytes
    return stats.read_elements / steps * dtype_bytes + scored_keys(session) * per_row


def scored_keys(session) -> float:
    """K/V row-equivalents per KV group and step that the method reads to choose and its cost model leaves out:
    the keys of every token held, for a method that scores every key (`Method.scores_every_key`); 0 otherwise."""
    if not session.method.scores_every_key:
        return 0.0
    layers = session.cache.layers
    return sum(layer.held_tokens() / layer.num_heads for layer in layers) / len(layers) / 2
