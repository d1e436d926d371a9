"""Needle-in-a-Haystack as a length x depth grid: the passkey test of Yuan et al. 2024 (RocketKV follows it).

Protocol (henryzhongsc/longctx_bench, `eval/passkey_utils/passkey_utils.py` and
`config/eval_config/paulgraham_passkey/*_7digits.json`):

- prompt = instruction + content + question, with the instruction "There is an important info hidden inside
  a lot of irrelevant text. ..." and the question "\\nWhat is the pass key? The pass key is ";
- background = Paul Graham essays repeated in order and cut to B words (a word is `\\S+` with its trailing
  whitespace, so the essays keep their line breaks);
- needle "The pass key is K. Remember it. K is the pass key." with K = 7 random digits (leading zeros
  allowed), inserted before background word int(B * depth): content = before + " " + needle + " " + after + " ";
- scoring: `passkey_exact_match` (normalised key is a substring of the normalised output); also in
  `meta["extra_metrics"]`: `passkey_partial_match` (longest common substring / key length);
- max_new_tokens 256, raw prompt without chat template (longctx_bench tokenises the prompt as is).

kvbench choices:

- Lengths are in tokens of the evaluated model by default (kvbench's choice): B is the largest word count
  whose prompt + max_new_tokens fits the length (RULER's binary search), found once per length with a probe
  needle at 50% depth; a sample that overflows backs off by 1% of B. `length_unit: words` reproduces the
  original grids, whose lengths are word counts (RocketKV: 10 lengths from 2,048 to 81,920 words).
- Depths are percentages in [0, 100] (Kamradt and RULER style; longctx_bench uses fractions).
- `num_samples` is the number of random keys per (length, depth) cell (longctx_bench: 3). Keys come from
  `sample_rng(seed, name, length, depth, rep)`.
- The question part is "\\nWhat is the pass key?" and the answer prefix " The pass key is ", so that with a
  chat template the cue starts the assistant turn; without one the prompt is the original string.
- `haystack: noise` uses RULER's filler sentences instead of the essays.
- The essays are concatenated in filename order (longctx_bench reads them in `os.listdir` order).

`Sample.meta` records the cell (length, depth, rep), the background size, the needle's word index, its
character span in the context and its token span counted from the start of the context part (measured
with the meter, without chat template; exact up to BPE merges at the span edges), so heatmaps and
needle-survival analyses can be made.
"""

from __future__ import annotations

import functools
import random
import re
import string
from collections.abc import Sequence
from typing import Any

from kvbench.tasks import haystack as hs
from kvbench.tasks.base import PromptMeter, Sample, Task, Turn, sample_rng

INSTRUCTION = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
               "I will quiz you about the important information there.\n")
QUESTION = "\nWhat is the pass key?"
ANSWER_PREFIX = " The pass key is "
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
DEFAULT_DEPTHS = tuple(range(0, 101, 10))
_WORD = re.compile(r"[^\s]+[\s]*")  # longctx_bench `count_words` / `truncate_string_by_word_count`


@functools.cache
def _background_words(haystack: str) -> tuple[str, ...]:
    if haystack == "essay":
        return tuple(_WORD.findall(hs.essay_text()))
    if haystack == "noise":
        return tuple(_WORD.findall(hs.NOISE_FILLER + " "))
    raise ValueError(f"unknown haystack {haystack!r}; use 'essay' or 'noise'")


class Niah(Task):
    """Passkey retrieval over a grid of lengths x depths, `num_samples` keys per cell.

    Args:
        name: run label, also Sample.task.
        seq_len: the single length used when `lengths` is null (tokens, prompt + max_new_tokens).
        num_samples: keys per (length, depth) cell.
        lengths: grid lengths; null means [seq_len].
        depths: needle depths in percent of the background.
        haystack: "essay" (Paul Graham) or "noise" (RULER filler).
        length_unit: "tokens" (size the background to the length) or "words" (the length is B).
        max_new_tokens: generation budget, counted in token lengths.
        chat_template: whether the engine wraps the prompt in the model's chat template.
        digits: passkey length.
    """

    def __init__(self, name: str = "niah", seq_len: int = 4096, num_samples: int = 3,
                 lengths: Sequence[int] | None = None, depths: Sequence[float] = DEFAULT_DEPTHS,
                 haystack: str = "essay", length_unit: str = "tokens", max_new_tokens: int = 256,
                 chat_template: bool = False, digits: int = 7):
        if length_unit not in ("tokens", "words"):
            raise ValueError(f"length_unit must be 'tokens' or 'words', not {length_unit!r}")
        if not depths or any(not 0 <= d <= 100 for d in depths):
            raise ValueError(f"depths are percentages in [0, 100], at least one: {list(depths)}")
        if lengths is not None and (not lengths or any(length < 1 for length in lengths)):
            raise ValueError(f"lengths are positive numbers of {length_unit}, at least one (or null: seq_len), "
                             f"got {list(lengths)}")
        if digits < 1:
            raise ValueError(f"digits (of the needle's number) must be at least 1, got {digits}")
        self.name = name
        self.seq_len = int(seq_len)
        self.num_samples = int(num_samples)
        self.lengths = [int(x) for x in lengths] if lengths is not None else [self.seq_len]
        self.depths = list(depths)
        self.haystack = haystack
        self.length_unit = length_unit
        self.max_new_tokens = int(max_new_tokens)
        self.chat_template = chat_template
        self.digits = int(digits)

    def _build(self, key: str, words: int, depth: float) -> tuple[str, dict[str, Any]]:
        background = hs.repeat_to(_background_words(self.haystack), words)
        pos = int(words * depth / 100)
        before, after = "".join(background[:pos]).strip(), "".join(background[pos:]).strip()
        needle = NEEDLE.format(key=key)
        # longctx_bench joins [before, needle, after, ""] with spaces, hence the trailing space.
        context = INSTRUCTION + f"{before} {needle} {after} "
        start = len(INSTRUCTION) + len(before) + 1
        return context, {"needle_word_index": pos, "needle_char_offset": start, "needle_char_end": start + len(needle)}

    def _key(self, rng: random.Random) -> str:
        return "".join(rng.choice(string.digits) for _ in range(self.digits))

    def _tokens(self, meter: PromptMeter, context: str) -> int:
        return meter(context, QUESTION, ANSWER_PREFIX, self.chat_template) + self.max_new_tokens

    def _words_for(self, meter: PromptMeter, seed: int, length: int) -> int:
        if self.length_unit == "words":
            return length
        probe_key = self._key(sample_rng(seed, self.name, length, "probe"))
        return hs.fit_haystack(lambda b: self._tokens(meter, self._build(probe_key, b, 50)[0]), length, start=100)

    def samples(self, meter: PromptMeter, seed: int) -> list[Sample]:
        empty = meter("", "", "", False)
        out: list[Sample] = []
        for length in self.lengths:
            words = self._words_for(meter, seed, length)
            for depth in self.depths:
                for rep in range(self.num_samples):
                    key = self._key(sample_rng(seed, self.name, length, depth, rep))
                    used = words
                    while True:
                        context, spans = self._build(key, used, depth)
                        tokens = self._tokens(meter, context)
                        if self.length_unit == "words" or tokens <= length:
                            break
                        if used <= 1:
                            raise ValueError(f"{self.name}: no background fits in {length} tokens")
                        used -= max(1, used // 100)
                    meta = {
                        "benchmark": "niah_passkey", "length": length, "length_unit": self.length_unit,
                        "depth": depth, "rep": rep, "seed": seed, "haystack": self.haystack,
                        "background_words": used, "total_tokens": tokens, "passkey": key, **spans,
                        "needle_token_offset": meter(context[:spans["needle_char_offset"]], "", "", False) - empty,
                        "needle_token_end": meter(context[:spans["needle_char_end"]], "", "", False) - empty,
                        "extra_metrics": ["passkey_partial_match"],
                    }
                    out.append(Sample(
                        id=f"{self.name}-{length}-d{depth}-{rep}",
                        task=self.name,
                        context=context,
                        turns=[Turn(question=QUESTION, answers=[key], max_new_tokens=self.max_new_tokens,
                                    metric="passkey_exact_match", answer_prefix=ANSWER_PREFIX)],
                        chat_template=self.chat_template,
                        meta=meta,
                    ))
        return out
