"""How fast an eager PyTorch decode step of a model can be at all, without the harness.

The step is written out by hand from the model's own modules (embedding, norms, the packed projections, rotary
embedding, MLP, output head) over a static cache written in place, with the one decode attention every method
uses (`kernels.decode_attention`): no cache object, no attention dispatcher, no method, no statistics.
`scripts/bench_eager_floor.py` prints it against the gemv floor; `scripts/bench_decode_latency.py` divides each
method's step by it.
"""

from __future__ import annotations

import statistics
import time

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kvbench.kernels.decode_attention import decode_attention
from kvbench.models import model_head_dim
from kvbench.profiling.roofline import phase_costs


def eager_step(lm, keys: list[torch.Tensor], values: list[torch.Tensor], rows: int, token: int) -> torch.Tensor:
    """One decode step at position `rows` over caches `[H_kv * capacity, D]` holding `rows` rows per head."""
    inner, config = lm.model.model, lm.model.config
    n_kv, head_dim = config.num_key_value_heads, model_head_dim(lm)
    capacity = keys[0].shape[0] // n_kv
    x = inner.embed_tokens(torch.tensor([[token]], device=lm.device))
    cos, sin = inner.rotary_emb(x, torch.tensor([[rows]], device=lm.device))
    for layer, k_buf, v_buf in zip(inner.layers, keys, values):
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q, k, v = (proj(h).view(1, 1, -1, head_dim).transpose(1, 2) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
        if hasattr(attn, "q_norm"):  # Qwen3
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k_buf.view(n_kv, capacity, head_dim)[:, rows] = k[0, :, 0]
        v_buf.view(n_kv, capacity, head_dim)[:, rows] = v[0, :, 0]
        out = decode_attention(q[0, :, 0].reshape(n_kv, -1, head_dim), k_buf, v_buf, attn.scaling,
                               [i * capacity for i in range(n_kv)], [rows + 1] * n_kv, [capacity] * n_kv)
        x = x + attn.o_proj(out.reshape(1, 1, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return lm.model.lm_head(inner.norm(x))[0, -1]


def time_eager_steps(lm, rows: int, steps: int, rounds: int = 1, rate_of=None) -> tuple[list[float], list[float]]:
    """ms of each of `rounds` x `steps` eager steps from `rows` cached rows per KV head on (one more per step),
    and each round's ratio to the gemv floor of its bytes when `rate_of` (the model -> bytes/s) is given."""
    config = lm.model.config
    n_kv, head_dim, layers = config.num_key_value_heads, model_head_dim(lm), config.num_hidden_layers
    capacity = rows + rounds * steps + 64
    gen = torch.Generator().manual_seed(0)
    keys, values = ([torch.randn(n_kv * capacity, head_dim, generator=gen).to(lm.dtype) for _ in range(layers)]
                    for _ in range(2))
    elem = torch.finfo(lm.dtype).bits // 8
    weights = phase_costs(config, rows, 0.0, elem)["decode_bytes_per_step"]
    times, ratios = [], []
    with torch.inference_mode():
        eager_step(lm, keys, values, rows, 5)  # warm-up: first calls allocate
        for _ in range(rounds):
            rate = rate_of(lm.model) if rate_of is not None else None
            round_times = []
            for _ in range(steps):
                start = time.perf_counter()
                eager_step(lm, keys, values, rows, 5)
                round_times.append(1e3 * (time.perf_counter() - start))
                rows += 1
            if rate is not None:
                floor = 1e3 * (weights + 2 * layers * n_kv * head_dim * elem * rows) / rate
                ratios.append(statistics.median(round_times) / floor)
            times += round_times
    return times, ratios
