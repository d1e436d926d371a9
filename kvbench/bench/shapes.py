"""The models and shapes the measurement scripts run at: Llama-3.1-8B's layer shapes by default, tiny ones to test.

`random_model_cfg` is kvbench's model config of a random Llama of the given shapes (tiny_llama's byte vocabulary),
`stock_model` the same shapes as stock transformers' Llama (SDPA attention, no kvbench in the loop), and
`model_config` a configured model or one decoder layer of Llama-3.1-8B's widths (`LAYER_MODEL`).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

import kvbench.conf

MODEL_CONFS = Path(kvbench.conf.__file__).parent / "model"
# one decoder layer of Llama-3.1-8B's shapes (random bf16 weights, a byte vocabulary): the steps' kernels at a GPU
# run's widths (the norms' reductions over 4,096 elements are loops, not the tiny models' single blocks)
LAYER_MODEL = "llama3.1_8b_layer"


def add_shape_arguments(parser: argparse.ArgumentParser, layers: int) -> None:
    """The model-shape flags of the GPU scripts: Llama-3.1-8B's layer shapes by default, tiny ones to test."""
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--hidden", type=int, default=4096, help="hidden size (Llama-3.1-8B's by default)")
    parser.add_argument("--intermediate", type=int, default=14336, help="MLP size")
    parser.add_argument("--heads", type=int, default=32, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)


def random_model_cfg(args: argparse.Namespace, max_positions: int = 131072) -> Any:
    """kvbench's model config of the random model with `args`' shapes (`add_shape_arguments`, `--dtype`,
    `--device`): tiny_llama's source and byte vocabulary; load it under `torch.device(args.device)` so that the
    weights are initialised there (seconds on a GPU, minutes on the CPU for 8B shapes)."""
    return OmegaConf.create({"name": "llama3.1_8b_shapes_random", "source": "tiny", "init_seed": 0,
                             "dtype": args.dtype, "device": args.device, "config": {
                                 "model_type": "llama", "hidden_size": args.hidden,
                                 "intermediate_size": args.intermediate, "num_hidden_layers": args.layers,
                                 "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads,
                                 "head_dim": args.head_dim, "max_position_embeddings": max_positions,
                                 "rope_theta": 500000.0}})


def stock_model(args: argparse.Namespace, device: torch.device, dtype: torch.dtype,
                max_positions: int = 131072) -> torch.nn.Module:
    """Stock transformers' Llama with `args`' shapes (layers, hidden, intermediate, heads, kv_heads, head_dim),
    tiny_llama's byte vocabulary, SDPA attention, random weights initialised on `device` (seed 0)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=260, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                         max_position_embeddings=max_positions, rope_theta=500000.0)
    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").eval()


def model_config(model: str, dtype: str | None = None) -> Any:
    """The config of `LAYER_MODEL` (one decoder layer of Llama-3.1-8B's widths, random bf16 weights) or of a
    configured model (`kvbench/conf/model`), in `dtype` if given."""
    if model == LAYER_MODEL:
        cfg = random_model_cfg(argparse.Namespace(layers=1, hidden=4096, intermediate=14336, heads=32,
                                                  kv_heads=8, head_dim=128, dtype="bfloat16", device="cpu"))
    else:
        cfg = OmegaConf.load(MODEL_CONFS / f"{model}.yaml")
    if dtype is not None:
        cfg.dtype = dtype
    return cfg


def topk_cases(length: int, capacity: int, budget: int, kv_heads: int, group: int) -> list[tuple[str, int, int, int]]:
    """(case, rows, row length, k) of each selection's stable top-k at a prompt of `length` tokens over a static
    layer of `capacity` slots: Quest's traffic-equivalent pages, pages of 16, a token-level top-k per KV head
    (SparQ, HSA, RocketKV's second stage) and one per query head (Exact-TopK)."""
    page = max(1, round(2 * length / budget))
    return [
        ("quest", kv_heads, -(-capacity // page), budget // 2 // page + 2),
        ("quest_page16", kv_heads, -(-capacity // 16), budget // 16 + 2),
        ("token_shared", kv_heads, capacity, budget),
        ("token_per_query_head", kv_heads * group, capacity, budget),
    ]
