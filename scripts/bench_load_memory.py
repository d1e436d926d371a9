"""Peak host memory of loading a model: today's load-then-move against `from_pretrained` with a device map (issue 47).

A random Llama (`--hidden`, `--layers`, default ~0.5 GB in float32) is saved once as sharded safetensors
(`--shard-mb` per shard). Each way of loading then runs in a fresh Python process, which prints its peak resident set
(`resource.getrusage(RUSAGE_SELF).ru_maxrss`, the kernel's high-water mark of the process, KiB on Linux) minus its
resident set just before the load (the interpreter, torch and transformers imported), so the number is what the load
itself staged on the host:

- `move`: `from_pretrained(dir, dtype=...)`, then `.to(device)`: kvbench's load before issue 47;
- `device_map`: `from_pretrained(dir, dtype=..., device_map={"": device})`: kvbench's load now.

On a CPU-only machine the target device is the host itself, so both end with the whole model resident; what differs
is how much more than the model the load stages on the way (the ratio printed). On a GPU (`--device cuda`) the
device-map load keeps no copy on the host at all.

    python scripts/bench_load_memory.py [--hidden 1024 --layers 12 --shard-mb 50 --device cpu]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, resource, sys, torch
from transformers import AutoModelForCausalLM
folder, way, device = sys.argv[1], sys.argv[2], sys.argv[3]
def rss_kib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
before = rss_kib()
if way == "move":
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device)
else:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, device_map={"": device})
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
weights = sum(p.numel() * p.element_size() for p in model.parameters())
print(json.dumps({"way": way, "staged_peak_bytes": (peak - before) * 1024, "weights_bytes": weights,
                  "after_bytes": (rss_kib() - before) * 1024}))
"""


def save_sharded(folder: Path, hidden: int, layers: int, shard_mb: int) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", vocab_size=32000, hidden_size=hidden, intermediate_size=4 * hidden,
                                  num_hidden_layers=layers, num_attention_heads=hidden // 64,
                                  num_key_value_heads=hidden // 128, head_dim=64)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder,
                                                                                  max_shard_size=f"{shard_mb}MB")


def measure(folder: Path, way: str, device: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(folder), way, device], capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--shard-mb", type=int, default=50)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=2, help="fresh processes per way; the smallest peak is kept")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        save_sharded(folder, args.hidden, args.layers, args.shard_mb)
        shards = len(list(folder.glob("*.safetensors")))
        results = {}
        for way in ("move", "device_map"):
            runs = [measure(folder, way, args.device) for _ in range(args.repeats)]
            results[way] = min(runs, key=lambda r: r["staged_peak_bytes"])
    weights = results["move"]["weights_bytes"]
    print(f"model: {weights / 2**20:.0f} MiB of float32 weights in {shards} safetensors shards; target {args.device}")
    for way, r in results.items():
        print(f"{way:>10}: peak host memory staged by the load {r['staged_peak_bytes'] / 2**20:7.0f} MiB "
              f"({r['staged_peak_bytes'] / weights:.2f}x the weights), resident after {r['after_bytes'] / 2**20:.0f} MiB")
    ratio = results["move"]["staged_peak_bytes"] / max(1, results["device_map"]["staged_peak_bytes"])
    print(f"load-then-move / device_map peak: {ratio:.2f}x")


if __name__ == "__main__":
    main()
