"""DuoAttention (Xiao et al., ICLR 2025, arXiv 2410.10819; code: github.com/mit-han-lab/duo-attention): retrieval
heads keep their whole KV cache, streaming heads keep only attention sinks and a window of recent tokens.

Which KV heads retrieve is decided by a *pattern*: one learned gate per (layer, KV head), DuoAttention's released
`full_attention_heads.tsv` (one row per layer, tab-separated gates; its `attn_patterns/<model>/<setting>/` folders
load as they are). `pattern` is a shipped name (kvbench/methods/patterns/duoattention/<name>.tsv; the config
passes `${model.name}`) or a path to such a file (or to a folder holding `full_attention_heads.tsv`). A model
without one is an error naming `python -m kvbench calibrate duoattention`, kvbench's port of the gate training
(kvbench/calibration/duoattention.py). The heads with the highest gates over all layers are the retrieval heads,
chosen as the release chooses them: `load_attn_pattern` clips the gates to [0, 1], then `sparsify_attention_heads`
(duo_attn/utils.py) adds uniform noise in [0, 1e-6) from numpy's global RNG, which eval/LongBench/pred.py seeds
with `seed_everything(42)` at start-up (its first numpy draw, as far as the release's code shows), and ranks the
noisy gates. kvbench draws the same
noise, `numpy.random.RandomState(seed).uniform(0, 1e-6, shape)` in float64, from the method's `seed` (conf:
`${seed}`, the run's seed, so it is in config.yaml and the point's identity; 42 by default, the release's draw).
Why it matters: the released patterns are rounded, so many gates tie at the maximum (110 of 256 heads of
Mistral-7B-Instruct-v0.2 at 1.0, 57 of 256 of Llama-3.1-8B-Instruct), and a rule that picks a few dozen of them
(RocketKV's, below) would otherwise take the lowest (layer, head) indices, i.e. the first layers only; the noise
spreads them over the tied heads of every layer, one fixed choice per run (per seed), as the release's. The noise
is below the gates' rounding, so it only orders ties. Shipped: all six of DuoAttention's released patterns (repository commit fe93c31, MIT licence; each .json sidecar
names its source), two under kvbench's model names (mistral_7b_instruct_v0.2, llama3.1_8b_instruct), the others
under their own (llama2_7b_32k_instruct, llama3_8b_instruct_gradient_1048k / _4194k, mistral_7b_instruct_v0.3:
a documented proxy for a related model is `method.pattern=<that name>`), and kvbench-calibrated ones for
smollm2_135m, tiny_llama and tiny_qwen3 (CPU-sized; the sidecar has the settings and loss curve).

How many heads retrieve (`budget_rule`):

- `rocketkv` (default; RocketKV's comparison, its App. A.3): t is the budget per KV head, S the sample's
  prompt plus its generation budget (the Plan's sequence_length). If t > 640: streaming heads keep 128 sinks +
  512 recent tokens, and round(rho * N) of the N KV heads of the model retrieve, rho = (t - 640) / (S - 640), so
  that the mean per-head cache over all heads is t. If t <= 640: every head streams, with sink = 128 if t > 256
  else round(0.2 t), recent = t - sink.
- `sparsity`: DuoAttention's own knob (eval/LongBench/pred.py): `sparsity` is the share of streaming heads
  (threshold = numpy quantile of the gates, heads at or above it retrieve, so ceil(sparsity * (N - 1)) heads
  stream, all of them at sparsity 1), with `sink` / `recent` (64 / 256, the repo's eval scripts). The budget is
  not used, except that a budget at or above S is full attention as for every method.

A budget at or above S is exact full attention (no eviction at all). Everything derived (rho, head counts, sink,
recent, the pattern's sha256, the tie-break seed and the retrieval heads themselves, `retrieval_head_ids`: layer *
KV heads + head) is in the Plan, so every record says which heads retrieved.

Cache: the layer becomes ragged (per KV head, as Ada-KV): retrieval heads never lose a token; streaming heads are
cut to their first `sink` and last `recent` tokens when the compressed segment ends and again after every decode
step (`decode_every: 1`), so they hold exactly sink + recent while decoding (a decode step attends over
sink + recent + the new token, as the release's streaming cache does before trimming). Evicted rows are freed
(`KVLayer.retain`: at the compression by a compact copy; a decode step's one-row cut moves the streaming heads'
rows down in place and leaves retrieval heads untouched), and `decode_read_tokens_per_group` is the default
traffic over what is stored.

Departures from the release, and why:
- Prefill is dense: every head attends to the whole prompt, then streaming heads are cut (kvbench applies no
  method during prefill, as RocketKV's App. A.3 states for every baseline; the release's prefill already
  streams in those heads).
  `block_size` runs it block-wise instead (streaming heads cut after every block, closer to the release's chunked
  prefill, whose streaming heads see sink + recent + the chunk).
- `dense_layers` heads count as retrieval heads (they keep everything), so the RocketKV rule still averages t:
  round(rho * N) minus the dense heads are picked by gate among the other layers.

Against the release's head split and streaming cache on the same tensors: docs/fidelity.md.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvbench.core.checks import is_int
from kvbench.core.contract import Plan
from kvbench.core.errors import KVBenchError
from kvbench.methods.base import EvictionMethod, register_method

PATTERN_DIR = Path(__file__).resolve().parent / "patterns" / "duoattention"
RELEASE_FILE = "full_attention_heads.tsv"  # a DuoAttention attn_patterns/<model>/<setting>/ folder holds it
CALIBRATE = "python -m kvbench calibrate duoattention model=<name> [steps=N seq_len=L out=FILE.tsv]"
STREAM_SINK, STREAM_RECENT = 128, 512  # RocketKV's streaming heads when t > 640
TIE_NOISE = 1e-6  # sparsify_attention_heads' uniform tie-break noise (duo_attn/utils.py)
BUDGET_RULES = ("rocketkv", "sparsity")


def shipped_patterns() -> list[str]:
    return sorted(p.stem for p in PATTERN_DIR.glob("*.tsv"))


def pattern_path(pattern: str) -> Path:
    """The file a `pattern` value names: a bare name is a shipped pattern, anything else a path (a folder: its
    `full_attention_heads.tsv`). ValueError naming `pattern` if there is no such file."""
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"pattern must be a shipped pattern name or a path to a .tsv, got {pattern!r}")
    bare = "/" not in pattern and "\\" not in pattern and not pattern.endswith(".tsv") and pattern not in (".", "..")
    path = PATTERN_DIR / f"{pattern}.tsv" if bare else Path(pattern).expanduser()
    if path.is_dir():
        path = path / RELEASE_FILE
    if not path.is_file():
        what = (f"no shipped DuoAttention pattern {pattern!r} (shipped: {', '.join(shipped_patterns())})" if bare
                else f"pattern file {str(path)!r} not found")
        raise ValueError(f"pattern: {what}; calibrate one with `{CALIBRATE}` and pass method.pattern=<its .tsv>")
    return path


def read_pattern(path: str | Path) -> torch.Tensor:
    """Gates `[layers, kv_heads]` (float64) of a DuoAttention `full_attention_heads.tsv`."""
    rows = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append([float(x) for x in line.replace("\t", " ").split()])
        except ValueError:
            raise ValueError(f"pattern {str(path)!r} line {number}: not tab-separated numbers") from None
    if not rows or any(len(r) != len(rows[0]) for r in rows):
        raise ValueError(f"pattern {str(path)!r}: expected one row of gates per layer, each with one gate per KV "
                         f"head; got rows of {sorted({len(r) for r in rows})} values")
    gates = torch.tensor(rows, dtype=torch.float64)
    if not torch.isfinite(gates).all():
        raise ValueError(f"pattern {str(path)!r}: gates must be finite numbers")
    return gates


def write_pattern(gates: torch.Tensor, path: str | Path) -> None:
    """Write gates `[layers, kv_heads]` as DuoAttention does (numpy.savetxt: '%.18e', tab-separated)."""
    lines = ["\t".join(f"{float(v):.18e}" for v in row) for row in gates.detach().double().cpu()]
    Path(path).write_text("\n".join(lines) + "\n")


def release_gates(gates: torch.Tensor, seed: int) -> torch.Tensor:
    """The gates as the release ranks them (float64): clipped to [0, 1] (`load_attn_pattern`), plus uniform noise
    in [0, 1e-6) from numpy's legacy generator seeded with `seed` (`sparsify_attention_heads` after
    `seed_everything(seed)`: the same draw as the release's for the same seed)."""
    noise = np.random.RandomState(seed).uniform(0, TIE_NOISE, tuple(gates.shape))
    return gates.double().clamp(0, 1) + torch.from_numpy(noise)


def rank_heads(gates: torch.Tensor, count: int, dense_rows: list[int] = (), seed: int | None = None) -> torch.Tensor:
    """Bool `[layers, heads]`: the retrieval heads. Rows in `dense_rows` retrieve wholly and count towards `count`;
    the rest of `count` goes to the highest gates of the other rows. With a `seed` the gates are ranked as the
    release ranks them (`release_gates`: ties broken by the seeded noise); without one, as stored, ties to the lower
    layer, then head (the order the noise replaces)."""
    layers, heads = gates.shape
    mask = torch.zeros(layers, heads, dtype=torch.bool)
    mask[list(dense_rows)] = True
    extra = max(0, count - int(mask.sum()))
    ranked = release_gates(gates, seed) if seed is not None else gates
    flat = ranked.flatten().masked_fill(mask.flatten(), float("-inf"))
    order = torch.sort(flat, descending=True, stable=True).indices[:min(extra, int((~mask).sum()))]
    mask.view(-1)[order] = True
    return mask


def rocketkv_split(budget: int, sequence_length: int, heads: int) -> dict:
    """RocketKV's DuoAttention budget rule: retrieval heads, sink and recent for a mean per-head cache of t."""
    if budget > STREAM_SINK + STREAM_RECENT:
        rho = (budget - STREAM_SINK - STREAM_RECENT) / (sequence_length - STREAM_SINK - STREAM_RECENT)
        return {"rho": rho, "retrieval_target": math.floor(rho * heads + 0.5), "sink": STREAM_SINK,
                "recent": STREAM_RECENT}
    sink = STREAM_SINK if budget > 256 else math.floor(0.2 * budget + 0.5)
    return {"rho": 0.0, "retrieval_target": 0, "sink": sink, "recent": budget - sink}


def sparsity_split(sparsity: float, heads: int) -> int:
    """Streaming heads under DuoAttention's `sparsify_attention_heads` (quantile threshold, >= retrieves)."""
    if sparsity >= 1:
        return heads
    return math.ceil(sparsity * (heads - 1) - 1e-9) if sparsity > 0 else 0


@register_method
@dataclass
class DuoAttention(EvictionMethod):
    name = "duoattention"
    ragged_layers = True
    pattern: str = "smollm2_135m"  # a shipped name (conf: ${model.name}) or a path to a full_attention_heads.tsv
    budget_rule: str = "rocketkv"  # rocketkv: mean per-head budget t (RocketKV §4); sparsity: DuoAttention's knob
    sparsity: float = 0.5  # budget_rule=sparsity: share of streaming heads (DuoAttention's pred.py default)
    sink: int = 64  # budget_rule=sparsity: streaming heads' sink tokens (DuoAttention's eval scripts)
    recent: int = 256  # budget_rule=sparsity: streaming heads' recent tokens (DuoAttention's eval scripts)
    decode_every: int | None = 1  # the streaming window slides: streaming heads cut after every decode step
    seed: int = 42  # the tie-break noise's numpy seed (conf: ${seed}; the release's pred.py seeds 42)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.gates = read_pattern(pattern_path(self.pattern))
        self.pattern_sha256 = hashlib.sha256(pattern_path(self.pattern).read_bytes()).hexdigest()
        if self.budget_rule not in BUDGET_RULES:
            raise ValueError(f"budget_rule must be one of {', '.join(BUDGET_RULES)}, not {self.budget_rule!r}")
        if isinstance(self.sparsity, bool) or not isinstance(self.sparsity, (int, float)) or not 0 <= self.sparsity <= 1:
            raise ValueError(f"sparsity (the share of streaming heads) must be in [0, 1], got {self.sparsity!r}")
        for field in ("sink", "recent"):
            if not is_int(getattr(self, field)) or getattr(self, field) < 0:
                raise ValueError(f"{field} must be a number of tokens >= 0, got {getattr(self, field)!r}")
        if not is_int(self.seed) or not 0 <= self.seed < 2**32:
            raise ValueError(f"seed (numpy's, for the gates' tie-break noise) must be an integer in [0, 2**32), "
                             f"got {self.seed!r}")
        if self.sink + self.recent < 1:
            raise ValueError("sink + recent must keep at least one token in a streaming head")
        self._masks: dict[tuple, torch.Tensor] = {}

    def check_shape(self, layers: int, kv_heads: int | None = None) -> None:
        """A pattern for another model is an error naming the calibrate command."""
        want = (layers, kv_heads if kv_heads is not None else self.gates.shape[1])
        if tuple(self.gates.shape) != want:
            raise KVBenchError(f"method.pattern={self.pattern!r} has {self.gates.shape[0]} layers x "
                               f"{self.gates.shape[1]} KV heads, this model {want[0]} x {want[1]}: calibrate "
                               f"its own with `{CALIBRATE}`")

    def plan(self, budget, *, sequence_length, new_tokens, head_dim, num_layers=None):
        if budget >= sequence_length:
            return Plan.full_attention()
        if num_layers is not None:
            self.check_shape(num_layers)
        layers, kv_heads = self.gates.shape
        heads = layers * kv_heads
        dense = sum(kv_heads for i in range(layers) if self.is_dense_layer(i))
        if self.budget_rule == "rocketkv":
            split = rocketkv_split(budget, sequence_length, heads)
        else:
            split = {"rho": None, "retrieval_target": heads - sparsity_split(self.sparsity, heads),
                     "sink": self.sink, "recent": self.recent}
        retrieval = min(heads, max(split["retrieval_target"], dense))
        window = split["sink"] + split["recent"]
        chosen = torch.nonzero(self.retrieval_mask(retrieval).flatten()).flatten().tolist()
        return Plan(evict=budget, select=None, derived={
            "budget_rule": self.budget_rule, "rho": split["rho"], "retrieval_heads": retrieval,
            "streaming_heads": heads - retrieval, "dense_layer_heads": dense, "retrieval_share": retrieval / heads,
            "sink": split["sink"], "recent": split["recent"],
            # what the cache averages per head once every generated token is in: the RocketKV rule's t
            "mean_head_budget": (retrieval * sequence_length + (heads - retrieval) * min(window, sequence_length))
            / heads,
            "pattern": self.pattern, "pattern_sha256": self.pattern_sha256[:16], "tie_break_seed": self.seed,
            "retrieval_head_ids": chosen})

    def retrieval_mask(self, count: int, device: torch.device | None = None) -> torch.Tensor:
        """Bool `[layers, kv_heads]`: the `count` retrieval heads (dense layers' heads first), the release's choice
        for this run's seed: one fixed pattern per run, every sample the same. On `device` (default the host), kept
        there: the compiled step reads it where it is, since a copy from pageable host memory inside a captured
        CUDA graph is refused (`Cannot copy between CPU and CUDA tensors during CUDA graph capture`, an H100:
        docs/journal/gpu.md, section 6), and `keep` puts it there before any decode step."""
        layers = self.gates.shape[0]
        dense = [i for i in range(layers) if self.is_dense_layer(i)]
        device = torch.device(device or "cpu")
        key = (count, tuple(dense), str(device))
        if key not in self._masks:
            self._masks[key] = rank_heads(self.gates, count, dense, seed=self.seed).to(device)
        return self._masks[key]

    def decode_eviction_scores(self, layer, budget, step):
        """The sliding window on the static layout: a streaming head over sink + recent tokens loses its oldest
        token that is not a sink (the sinks are its first slots, never overwritten); retrieval heads keep all."""
        derived = step.plan.derived
        positions = layer.head_view().positions.float()
        sinks = torch.arange(positions.shape[1], device=positions.device) < derived["sink"]
        retrieves = self.retrieval_mask(derived["retrieval_heads"], positions.device)[layer.layer_idx]
        keep = torch.where(retrieves, torch.iinfo(torch.int64).max, derived["sink"] + derived["recent"])
        return positions.masked_fill(sinks[None, :], float("inf")), keep

    def keep(self, layer, budget, step):
        derived = step.plan.derived
        self.check_shape(step.num_layers, layer.num_heads)
        device = layer.keys.device
        # made on the layer's device here, before any decode step reads it
        retrieves = self.retrieval_mask(derived["retrieval_heads"], device)[layer.layer_idx].tolist()
        sink, recent = derived["sink"], derived["recent"]
        kept, cut = [], False
        for retrieval, n in zip(retrieves, layer.lengths()):
            if retrieval or n <= sink + recent:
                kept.append(torch.arange(n, device=device))
                continue
            kept.append(torch.cat([torch.arange(sink, device=device), torch.arange(n - recent, n, device=device)]))
            cut = True
        return kept if cut else None
