"""A model larger than one GPU in bf16, on one GPU: Llama-3.1-70B's shapes in 4-bit NF4 (OmniKV's 70B setting,
`model=llama3.1_70b_instruct`), random weights, one prefill and a few decode steps per method, memory per device.

    python scripts/gpu_big_model.py                    # the 70B shapes on cuda (docs/gpu/README.md, section 6)
    python scripts/gpu_big_model.py --device cpu --dtype float32 --layers 4 --hidden 64 --intermediate 128 \\
        --heads 4 --kv-heads 2 --head-dim 16 --vocab 260 --length 96 --filter-layers 1 --no-config-check  # CPU smoke

No hub is reachable on a lent GPU machine and 70B weights in bf16 (141 GB) fit neither its disk nor one GPU, so
the weights are random and built in place, not read by `from_pretrained`: the decoder is made on the meta device,
its linear layers are swapped for bitsandbytes' `Linear4bit` by transformers' own `replace_with_bnb_linear` with
kvbench's `BitsAndBytesConfig` for `bnb_4bit` (`kvbench.models.placement.quantization_config`: NF4, compute in
bf16), and each weight is drawn on the device and quantised there, layer by layer, so no full-precision copy of
the model ever exists; embeddings, norms and the output head stay in the compute dtype, as transformers' quantizer
leaves them. What the load path itself does (`from_pretrained` with the quantisation config and a device map) is
tested on CPU with tiny models (tests/test_quantized_models.py, tests/test_device_map.py); this script checks what
only the real size shows: that the config's memory check passes on this GPU, that 70B in NF4 fits one GPU with
room for a long prompt's K/V, and that kvbench's cache, methods and eager decode run on it (a model placed through
a device map decodes eagerly: `kvbench.engine.compiled.SHARDED_REASON`).

First `check_placement` on the model config node (`--model-config`, default the 70B node): the weights' estimate
against the device's memory, as a run does before its point directory exists. Then per method (`--methods`; OmniKV
with `--filter-layers`, the authors' list for this model): prefill `--length` random tokens, `--steps` greedy
decode steps (ms each, synchronised), and per device the memory held by the weights (their real size, quantisation
state included: `LoadedModel.weight_bytes_by_device`), the allocator's peak during the method, and the K/V the
cache holds after prefill.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

# Llama-3.1-70B-Instruct's config.json (meta-llama/Llama-3.1-70B-Instruct): the shapes and RoPE scaling
LLAMA_70B = {"hidden": 8192, "intermediate": 28672, "layers": 80, "heads": 64, "kv_heads": 8, "head_dim": 128,
             "vocab": 128256}
ROPE_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
GIB = 2**30


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", help="compute dtype (OmniKV's 70B setting: bfloat16)")
    parser.add_argument("--quantization", default="bnb_4bit", choices=["bnb_4bit", "bnb_8bit"])
    for flag, value in LLAMA_70B.items():
        parser.add_argument(f"--{flag.replace('_', '-')}", type=int, default=value)
    parser.add_argument("--length", type=int, default=16384, help="prompt tokens (random ids)")
    parser.add_argument("--steps", type=int, default=8, help="greedy decode steps timed after 2 warm-up steps")
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--methods", default="full,snapkv,omnikv")
    parser.add_argument("--filter-layers", default="4,19,41",
                        help="OmniKV's filter layers (0-based) for Llama-3.1-70B (seed 004, App. B)")
    parser.add_argument("--model-config", default="llama3.1_70b_instruct",
                        help="the kvbench/conf/model node whose placement check runs first")
    parser.add_argument("--no-config-check", dest="model_config", action="store_const", const=None)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def check_config(name: str, device: torch.device, dtype: torch.dtype) -> None:
    """The model node's placement check, as a run makes it before its point directory exists."""
    from omegaconf import OmegaConf

    from kvbench.bench.shapes import MODEL_CONFS
    from kvbench.models.placement import available_memory, check_placement, device_map_of, weight_bytes_estimate

    cfg = OmegaConf.load(MODEL_CONFS / f"{name}.yaml")
    start = time.perf_counter()
    check_placement(cfg, device, dtype)  # raises KVBenchError (one line) where it cannot fit
    needed = weight_bytes_estimate(cfg, dtype, str(cfg.quantization))
    total, where = available_memory(device, device_map_of(cfg))
    print(f"placement check of model={name} ({cfg.quantization}, device_map {cfg.device_map}): passes; weights "
          f"about {needed / GIB:.1f} GiB of {total / GIB:.1f} GiB on {where} ({time.perf_counter() - start:.1f} s)")


def build(args: argparse.Namespace, device: torch.device, dtype: torch.dtype):
    """The random quantised model, built on `device` one weight at a time (see the module docstring)."""
    from accelerate import init_empty_weights
    from bitsandbytes.nn import Linear4bit, Linear8bitLt, Params4bit
    from transformers import AutoModelForCausalLM, LlamaConfig
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear

    from kvbench.attention.dispatch import ATTENTION_NAME, register_attention
    from kvbench.models import LoadedModel, byte_tokenizer, check_supported
    from kvbench.models.placement import quantization_config

    register_attention()
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, head_dim=args.head_dim, max_position_embeddings=131072,
                         rope_parameters=dict(ROPE_LLAMA3), tie_word_embeddings=False, bos_token_id=0,
                         eos_token_id=1)
    config._attn_implementation = ATTENTION_NAME
    with init_empty_weights(include_buffers=False):  # parameters on meta; RoPE's buffers computed for real
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=ATTENTION_NAME)
    model = replace_with_bnb_linear(model, modules_to_not_convert=["lm_head"],
                                    quantization_config=quantization_config(args.quantization, dtype))
    gen = torch.Generator(device=device).manual_seed(args.seed)
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            data = torch.empty(param.shape, dtype=dtype, device=device)
            if name == "weight" and param.dim() == 1:
                data.fill_(1.0)  # a norm's scale
            else:
                data.normal_(0.0, 0.02, generator=gen)
            if isinstance(module, Linear4bit) and name == "weight":
                weight = Params4bit(data, requires_grad=False, blocksize=param.blocksize,
                                    compress_statistics=param.compress_statistics, quant_type=param.quant_type,
                                    quant_storage=param.quant_storage, module=module)
                module.weight = weight.to(device)  # quantised here: the bf16 draw is freed with `data`
            elif isinstance(module, Linear8bitLt) and name == "weight":
                module.weight = type(param)(data, requires_grad=False, has_fp16_weights=False).to(device)
            else:
                setattr(module, name, torch.nn.Parameter(data, requires_grad=False))
            del data
        for name, buffer in list(module.named_buffers(recurse=False)):
            module.register_buffer(name, buffer.to(device), persistent=False)
    model.eval()
    check_supported(model)
    lm = LoadedModel(model, byte_tokenizer(), "llama3.1_70b_shapes_random", 131072, quantization=args.quantization)
    lm.placement = {"": str(device)}  # as from_pretrained(device_map="auto") on one device reports it
    return lm


def memory_line(device: torch.device) -> str:
    if device.type == "cuda":
        i = device.index or 0
        return (f"{device}: allocated {torch.cuda.memory_allocated(i) / GIB:.2f} GiB, "
                f"peak {torch.cuda.max_memory_allocated(i) / GIB:.2f} GiB, "
                f"of {torch.cuda.get_device_properties(i).total_memory / GIB:.1f} GiB")
    import resource

    return f"host: peak resident {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB"


def run_method(lm, name: str, args: argparse.Namespace, ids: list[int]) -> dict:
    from kvbench.bench.timing import time_decode
    from kvbench.engine.sample import sample_generator
    from kvbench.engine.session import Session
    from kvbench.methods import build_method
    from kvbench.models import model_head_dim

    params = {"filter_layers": [int(x) for x in args.filter_layers.split(",")]} if name == "omnikv" else {}
    method = None if name == "full" else build_method(name, **params)
    new = 2 + args.steps + 1
    plan = None if method is None else method.plan(args.budget, sequence_length=args.length + new, new_tokens=new,
                                                   head_dim=model_head_dim(lm),
                                                   num_layers=lm.model.config.num_hidden_layers)
    if lm.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(lm.device)
    session = Session(lm, method, plan, generator=sample_generator(args.seed, "big-model"))
    with torch.no_grad():
        logits, prefill_s = session.prefill(ids, compress=True)
        kv_gib = session.cache.kv_bytes() / GIB
        times, _ = time_decode(lm, session, logits, 2, args.steps)
    row = {"method": name, "prefill_s": prefill_s, "decode_ms": statistics.median(times), "kv_gib": kv_gib,
           "path": "eager" if session.static_steps == 0 else "compiled", "memory": memory_line(lm.device)}
    del session, logits
    return row


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from kvbench.core.errors import KVBenchError
    from kvbench.models import DTYPES

    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    if args.model_config:
        try:
            check_config(args.model_config, device, dtype)
        except KVBenchError as exc:
            print(f"placement check of model={args.model_config}: {exc}")
            return 1
    start = time.perf_counter()
    lm = build(args, device, dtype)
    weights = lm.weight_bytes_by_device()
    print(f"built {args.layers} layers ({args.quantization}, {args.dtype} compute, random weights) on {device} in "
          f"{time.perf_counter() - start:.1f} s; weights per device: "
          + ", ".join(f"{d} {b / GIB:.2f} GiB" for d, b in weights.items()) + f"; {memory_line(device)}", flush=True)
    ids = torch.randint(4, args.vocab, (args.length,), generator=torch.Generator().manual_seed(args.seed)).tolist()
    print(f"\n| method | prompt | prefill s | decode ms/token (median of {args.steps}) | K/V after prefill GiB | path "
          "| memory |\n|---|---:|---:|---:|---:|---|---|", flush=True)
    failed = 0
    for name in args.methods.split(","):
        try:
            row = run_method(lm, name, args, ids)
        except Exception as exc:  # noqa: BLE001 - report it and go on to the next method
            failed += 1
            print(f"| {name} | {args.length} | - | - | - | failed | {type(exc).__name__}: {exc} |", flush=True)
            continue
        print(f"| {name} | {args.length} | {row['prefill_s']:.2f} | {row['decode_ms']:.1f} | {row['kv_gib']:.3f} | "
              f"{row['path']} | {row['memory']} |", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
