"""2StageRetr (OmniKV, ICLR 2025, App. A), seeded; plus `twostage_retr_long`, a kvbench extension.

The model must compute a + b and then read the colour stored under that key in a dictionary that comes
before the equation, so prefill-time attention cannot know which entry matters.

Protocol (antgroup/OmniKV `tiny_runs/make_2_stage_questions.py`, `benchmark/long_bench/cot_pred.py`,
`configs/template_for_chat.py`):

- dictionary keys 0..n-1 in order, each value drawn from 23 colours (repeats allowed), n cycling through
  40, 50, 60, 70, 80, 90, 100, 140, 180, 200 over the sample index; 100 samples;
- key ~ U{0..n-1}, a ~ U{0..key}, b = key - a;
- prompt = INSTRUCTION + " The Dict is " + str(dict) + "\\n" + "The equation is a + b = ?\\n" + TAIL;
- CoT (default): TAIL asks to output the sum first; the assistant turn is pre-filled with OmniKV's Llama
  CoT lead-in. Direct: TAIL asks for the colour directly and the assistant turn is pre-filled with
  "... The corresponding color is" (cot_pred.py's non-CoT rewrite);
- greedy, max 200 new tokens (OmniKV used 50 for Yi);
- accuracy: `substring_ci` (gold colour, lower-cased, is a substring of the lower-cased output). The strict
  `last_colour_match` is listed in `meta["extra_metrics"]`; report both, the lenient one is paper-comparable.

kvbench choices:

- Randomness: `sample_rng(seed, name, seq_len, index)`; the original script calls `random` unseeded.
- The dictionary is printed with Python's `str(dict)` (quoted colours, `{0: 'lime', ...}`) as the script
  does; the paper's App. A example shows it unquoted (`quote_values: false`).
- Three-part split: the context is the instruction and the dictionary, the question is the equation and
  the tail, so question-agnostic compression sees only the dictionary.
- OmniKV used its own Llama chat string with the system prompt "You are a helpful assistant."; kvbench
  leaves the chat template to the engine and keeps only the assistant lead-in (`answer_prefix`).
- `sizes: null` (the `twostage_retr_long` config) sizes the dictionary to fill `seq_len` with RULER's
  binary search (a sample that overflows drops 1% of its entries). This is not the paper's task; report it as
  2StageRetr-long. The authors' probe script went up to 10,000 entries.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from kvbench.tasks import haystack as hs
from kvbench.tasks.base import PromptMeter, Sample, Task, Turn, sample_rng
from kvbench.tasks.metrics import COLOURS

INSTRUCTION = ("Let's play a game. You have a dict and a mathematical addition equation. The keys of a dictionary "
               "can be any number. You need to find the corresponding key value in the dictionary after "
               "performing the addition and output the value corresponding to that key.")
COT_TAIL = "MUST first output the result of the addition, and then answer the corresponding value based on the result."
DIRECT_TAIL = "Directly answer the corresponding color based on the equation result."
COT_LEAD_IN = ("First, for a precise answer, we can break down this multi-hop question into two to four "
               "sub-questions, as follows:")
DIRECT_LEAD_IN = ("The equation result should be used as a key to find the value in the dictionary.\n"
                  "Then, i will directly give the color. The corresponding color is")
PAPER_SIZES = (40, 50, 60, 70, 80, 90, 100, 140, 180, 200)


class TwoStageRetr(Task):
    """2StageRetr samples (paper sizes), or dictionaries sized to `seq_len` when `sizes` is null.

    Args:
        name: run label, also Sample.task.
        seq_len: token bound (prompt + max_new_tokens); the paper-size variant only checks it.
        num_samples: number of samples (the authors generated 100).
        sizes: dictionary sizes cycled over the sample index; null fills seq_len instead.
        cot: chain-of-thought tail and lead-in (True) or direct answering (False).
        quote_values: print the dictionary with quoted colours, as `str(dict)` does.
        answer_prefix: assistant lead-in; null means OmniKV's lead-in for the chosen mode.
        max_new_tokens: generation budget.
        chat_template: whether the engine wraps the prompt in the model's chat template.
        preamble: text before the instruction: the head of OmniKV's raw Yi template ("You are helpful assistant
            who thinks step by step. ...", configs/template_for_chat.py), which wraps 2StageRetr for Yi-9B-200K
            (Table 6) since that base model has no chat template; "" (default): nothing.
    """

    def __init__(self, name: str = "twostage_retr", seq_len: int = 4096, num_samples: int = 100,
                 sizes: Sequence[int] | None = PAPER_SIZES, cot: bool = True, quote_values: bool = True,
                 answer_prefix: str | None = None, max_new_tokens: int = 200, chat_template: bool = True,
                 preamble: str = ""):
        if sizes is not None and (not sizes or any(size < 1 for size in sizes)):
            raise ValueError(f"sizes are the dictionaries' entry counts, each at least 1 (or null: the size that "
                             f"fills seq_len), got {list(sizes)}")
        self.name = name
        self.seq_len = int(seq_len)
        self.num_samples = int(num_samples)
        self.sizes = [int(s) for s in sizes] if sizes is not None else None
        self.cot = cot
        self.quote_values = quote_values
        self.answer_prefix = answer_prefix if answer_prefix is not None else (COT_LEAD_IN if cot else DIRECT_LEAD_IN)
        self.max_new_tokens = int(max_new_tokens)
        self.chat_template = chat_template
        self.preamble = preamble

    def _build(self, rng: random.Random, n: int) -> tuple[str, str, str, dict[str, Any]]:
        colours = [rng.choice(COLOURS) for _ in range(n)]
        key = rng.randint(0, n - 1)
        a = rng.randint(0, key)
        b = key - a
        if self.quote_values:
            table = str(dict(enumerate(colours)))
        else:
            table = "{" + ", ".join(f"{i}: {c}" for i, c in enumerate(colours)) + "}"
        context = self.preamble + INSTRUCTION + f" The Dict is {table}\n"
        question = f"The equation is {a} + {b} = ?\n" + (COT_TAIL if self.cot else DIRECT_TAIL)
        lead = "{" if key == 0 else ", "
        entry = context.index(f"{lead}{key}: ", len(self.preamble) + len(INSTRUCTION)) + len(lead)
        return context, question, colours[key], {"dict_size": n, "key": key, "a": a, "b": b, "key_char_offset": entry}

    def _tokens(self, meter: PromptMeter, context: str, question: str) -> int:
        return meter(context, question, self.answer_prefix, self.chat_template) + self.max_new_tokens

    def samples(self, meter: PromptMeter, seed: int) -> list[Sample]:
        fitted = None
        if self.sizes is None:
            def probe(n: int) -> int:
                context, question, _, _ = self._build(sample_rng(seed, self.name, self.seq_len, "probe"), n)
                return self._tokens(meter, context, question)
            fitted = hs.fit_haystack(probe, self.seq_len, start=10)
        empty = meter("", "", "", False)
        out: list[Sample] = []
        for index in range(self.num_samples):
            n = fitted if fitted is not None else self.sizes[index % len(self.sizes)]
            while True:
                context, question, gold, meta = self._build(sample_rng(seed, self.name, self.seq_len, index), n)
                tokens = self._tokens(meter, context, question)
                if tokens <= self.seq_len:
                    break
                if fitted is None or n <= 1:
                    raise ValueError(f"{self.name} sample {index} needs {tokens} tokens > seq_len {self.seq_len}")
                n -= max(1, n // 100)
            meta.update({
                "benchmark": "2stageretr" if fitted is None else "2stageretr_long",
                "seq_len": self.seq_len, "total_tokens": tokens, "seed": seed, "index": index, "cot": self.cot,
                "key_token_offset": meter(context[:meta["key_char_offset"]], "", "", False) - empty,
                "extra_metrics": ["last_colour_match"],
            })
            out.append(Sample(
                id=f"{self.name}-{self.seq_len}-{index}",
                task=self.name,
                context=context,
                turns=[Turn(question=question, answers=[gold], max_new_tokens=self.max_new_tokens,
                            metric="substring_ci", answer_prefix=self.answer_prefix)],
                chat_template=self.chat_template,
                meta=meta,
            ))
        return out
