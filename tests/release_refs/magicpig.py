"""MagicPIG's decode step as its release computes it: Infini-AI-Lab/MagicPIG, commit
ac9aa36c866330ca6ad2ce342a7848d7df6f49bb: `models/attnserver.py` (`LSHSparseAttnServer.fill`/`prefill` and
`decode`), `library/lsh/lsh.cc` (`LSH::retrieve`), `library/sparse_attention/sparse_attention.cc`
(`transform_kernel`, `softmax_kernel`, the merge with the GPU half's log-sum-exp).

After the prompt: the first `num_sink_tokens` and last `num_local_tokens` stay on the GPU; the rest move to the
CPU; every key (both halves, and each later one) is centred on the offloaded keys' mean (`avg_k`, per KV head);
the offloaded keys are hashed: per table the K signs of `key @ hash_func > 0` packed with weights 2^i. A decode
step hashes each query head the same way; `retrieve` returns the keys of its KV group that share the query's
bucket in at least two tables; `transform_kernel` turns each retrieved key's score `s = q . k` into
`s / sqrt(D) - log(w + 1e-4)`, with `theta = acos(s / (|q| |k|))`, `p = (1 - theta/pi)^K`,
`w = 1 - (1 - p)^(L - 1) (L p + 1 - p)` (float32); the CPU softmax over the retrieved keys and the GPU attention over
its rows are merged by their log-sum-exps. The hyperplanes (`hash_func`, `torch.randn`) are an input here, so
that the reference and kvbench hash with the same draw.
"""

from __future__ import annotations

import math

import torch


def codes(x: torch.Tensor, hash_func: torch.Tensor, bits: int, tables: int) -> torch.Tensor:
    """`[..., L]` bucket ids of `[..., D]` vectors."""
    signs = (x @ hash_func > 0).float().reshape(*x.shape[:-1], tables, bits)
    return (signs * (2.0 ** torch.arange(bits))).sum(-1).to(torch.int64)


def magicpig_decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, hash_func: torch.Tensor, bits: int,
                    tables: int, sink: int, local: int, weight_dtype: torch.dtype = torch.float32):
    """q `[H_kv, G, D]` (the decode query), keys/values `[H_kv, n + 1, D]` (the prompt and the decode token).
    Returns the output `[H_kv, G, D]` and, per query head, the sorted retrieved (offloaded) positions.
    `weight_dtype`: the release's float32 for theta, p and w, or float64 to isolate its rounding."""
    heads, group, dim = q.shape
    n = keys.shape[1] - 1
    offload = torch.arange(sink, n - local)
    gpu = torch.cat([torch.arange(sink), torch.arange(n - local, n + 1)])
    avg_k = keys[:, offload].mean(dim=1, keepdim=True)
    centred = keys - avg_k
    k_codes = codes(centred[:, offload], hash_func, bits, tables)  # [H, M, L]
    q_codes = codes(q / q.norm(p=2, dim=-1, keepdim=True), hash_func, bits, tables)  # [H, G, L]
    collisions = (k_codes[:, None] == q_codes[:, :, None]).sum(-1)  # [H, G, M]
    out = torch.empty_like(q)
    retrieved = []
    for h in range(heads):
        for g in range(group):
            rows = offload[collisions[h, g] >= 2]
            retrieved.append(rows.tolist())
            qv = q[h, g]
            gpu_logits = centred[h, gpu] @ qv / math.sqrt(dim)
            score = centred[h, rows] @ qv
            norm = qv.norm() * centred[h, rows].norm(dim=-1)
            theta = torch.acos((score / norm).to(weight_dtype))
            p = (1 - theta / math.pi) ** bits
            w = 1 - (1 - p) ** (tables - 1) * (tables * p + (1 - p))
            cpu_logits = score / math.sqrt(dim) - torch.log(w + 1e-4).float()
            logits = torch.cat([gpu_logits, cpu_logits])
            probs = torch.softmax(logits, dim=-1)
            out[h, g] = probs @ torch.cat([values[h, gpu], values[h, rows]])
    return out, retrieved
