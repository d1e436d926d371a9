"""How each sample picks its next token: greedily (argmax, the default) or by seeded sampling where the task's
protocol samples (`Sample.meta["sampling"]`, e.g. Math-500's 5 responses per problem at temperature 0.6 and top-p
0.95) and `engine.sampling=auto` honours it.

Sampling follows transformers' `generate(do_sample=True)` step for step: the logits processors first (here the
EOS mask before `min_new_tokens`, as `MinNewTokensLengthLogitsProcessor`), then the warpers in transformers'
order, `TemperatureLogitsWarper` (scores / T, applied when T != 1), `TopKLogitsWarper` (only where a protocol gives
`top_k`), `TopPLogitsWarper` (applied when top-p < 1: sort ascending, drop the tokens whose cumulative probability
is <= 1 - top-p, always keep the most probable one, `min_tokens_to_keep=1` as in single-beam sampling), then
softmax and `torch.multinomial(probs, 1)`. What is chosen where transformers leaves it open:

- No top-k unless the protocol names one. `generate` falls back to top_k=50 when a checkpoint's
  generation_config sets none; DeepSeek's R1 protocol (temperature 0.6, top-p 0.95) and vLLM, which KeyDiff's
  numbers are comparable with, use none.
- The draw is made on the CPU in float32 from a `torch.Generator` of the sample's own (seeded with
  `meta["sampling"]["seed"]`, else from the run's seed and the sample's id), never from the global generator or
  the device's: a sample draws the same whatever other rows or points decode beside it, on whatever device, and
  a method's own draws (`Step.generator`, random eviction) are a different stream that does not shift these.
  The logits are copied to the host for it (one vocabulary-sized vector per step).
- A temperature of 0 (or none) in a protocol means greedy, as vLLM reads it.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any

import torch

from kvbench.core.errors import KVBenchError

SAMPLING_SETTINGS = ("auto", "greedy")


@dataclass(frozen=True)
class Decoding:
    """How one sample decodes: `kind` greedy or sampled; a sampled one's temperature, top-p, top-k (None: no
    top-k) and seed; `ignored`: a protocol's sampling settings that `engine.sampling=greedy` set aside."""

    kind: str = "greedy"
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    ignored: dict[str, Any] | None = None

    @property
    def sampled(self) -> bool:
        return self.kind == "sampled"

    def record(self) -> dict[str, Any]:
        """The record's `decoding` field: `{"kind": "greedy"}`, with `ignored` and the setting that ignored it where
        the task asked to sample, or `{"kind": "sampled", "temperature", "top_p", "top_k", "seed"}`."""
        if not self.sampled:
            if self.ignored is None:
                return {"kind": "greedy"}
            return {"kind": "greedy", "ignored": dict(self.ignored), "by": "engine.sampling=greedy"}
        return {"kind": "sampled", "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                "seed": self.seed}


GREEDY = Decoding()


def protocol_samples(sampling: Any) -> bool:
    """Whether a protocol (a `meta["sampling"]` mapping, or a task config with a `temperature`) asks to sample:
    a positive temperature. 0 or none is greedy."""
    if not sampling:
        return False
    temperature = sampling.get("temperature")
    return temperature is not None and not isinstance(temperature, bool) and float(temperature) > 0


def decoding_for(sample: Any, setting: str, run_seed: int) -> Decoding:
    """The decoding of `sample` under `engine.sampling=setting`: its task's protocol (`meta["sampling"]`) with
    `auto`, greedy with `greedy` (the record keeps what was set aside). Bad protocol values are one error line."""
    if setting not in SAMPLING_SETTINGS:
        raise KVBenchError(f"engine.sampling={setting!r}: expected auto (the task's protocol) or greedy")
    protocol = sample.meta.get("sampling")
    if not protocol_samples(protocol):
        return GREEDY
    if setting == "greedy":
        return Decoding(ignored=dict(protocol))
    temperature = float(protocol["temperature"])
    top_p = protocol.get("top_p")
    top_p = 1.0 if top_p is None else float(top_p)
    top_k = protocol.get("top_k")
    if not math.isfinite(temperature) or not 0 < top_p <= 1:
        raise KVBenchError(f"sample {sample.id}: sampling needs a finite temperature > 0 and top_p in (0, 1], got "
                           f"temperature={protocol['temperature']!r}, top_p={protocol.get('top_p')!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0):
        raise KVBenchError(f"sample {sample.id}: sampling's top_k must be a non-negative integer, got {top_k!r}")
    seed = protocol.get("seed")
    if seed is None:  # a protocol without a per-sample seed: one from the run's seed and the sample's id
        digest = hashlib.sha256(f"{run_seed}\0{sample.id}\0decoding".encode()).digest()
        seed = int.from_bytes(digest[:8], "little") >> 1
    return Decoding("sampled", temperature, top_p, top_k or None, int(seed))


def warp(logits: torch.Tensor, temperature: float, top_p: float, top_k: int | None = None) -> torch.Tensor:
    """transformers' warpers on one row of float32 scores, in `generate`'s order: temperature, top-k, top-p
    (min_tokens_to_keep = 1). Removed tokens get -inf."""
    scores = logits
    if temperature != 1.0:
        scores = scores / temperature
    if top_k:
        k = min(max(top_k, 1), scores.size(-1))
        scores = scores.masked_fill(scores < torch.topk(scores, k)[0][..., -1, None], float("-inf"))
    if top_p < 1.0:
        sorted_scores, sorted_indices = torch.sort(scores, descending=False)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative <= (1 - top_p)
        remove_sorted[..., -1:] = False  # the most probable token always stays
        remove = remove_sorted.scatter(-1, sorted_indices, remove_sorted)
        scores = scores.masked_fill(remove, float("-inf"))
    return scores


class TokenChooser:
    """Picks one sample's tokens: argmax for greedy decoding (the engine's path, unchanged), or a seeded draw from
    the warped distribution. One per sample and decode (its generator runs on across the sample's turns)."""

    def __init__(self, decoding: Decoding):
        self.decoding = decoding
        self.generator = torch.Generator().manual_seed(decoding.seed) if decoding.sampled else None

    def __call__(self, logits: torch.Tensor) -> int:
        if self.generator is None:
            return int(torch.argmax(logits))
        d = self.decoding
        scores = warp(logits.detach().to("cpu", torch.float32), d.temperature, d.top_p, d.top_k)
        probs = scores.softmax(dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))
