"""Synthetic prompts for efficiency sweeps: token ids at an exact length, no task, no score.

`kind=random` draws every token uniformly from the model's ordinary vocabulary (special tokens excluded);
`kind=repeat` repeats one ordinary token. The ids are drawn by the engine's prompt builder from the
recipe in `Sample.token_prompt` (this module never needs the tokenizer), seeded per sample, so a length
grid is reproducible and every method of a sweep sees the same prompt. `lengths` gives several lengths in
one point (OmniKV Fig. 4's x axis); each length is `num_samples` samples whose id says the length.
Records carry `score: null`: these samples measure time and memory, not accuracy.
"""

from __future__ import annotations

from kvbench.tasks.base import PromptMeter, Sample, Task, Turn

KINDS = ("random", "repeat")


class Synthetic(Task):
    def __init__(
        self,
        name: str = "synthetic",
        seq_len: int = 4096,
        lengths: list[int] | None = None,
        num_samples: int = 1,
        kind: str = "random",
        max_new_tokens: int = 64,
    ):
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r} is not one of {', '.join(KINDS)}")
        self.name = name
        self.lengths = [int(n) for n in (lengths or [seq_len])]
        if any(n <= max_new_tokens for n in self.lengths):
            raise ValueError(f"every length (prompt + new tokens) must exceed max_new_tokens={max_new_tokens}")
        self.num_samples, self.kind, self.max_new_tokens = num_samples, kind, max_new_tokens

    def samples(self, meter: PromptMeter, seed: int) -> list[Sample]:
        del meter  # lengths are exact token counts
        out = []
        for length in self.lengths:
            if self.max_positions is not None and length > self.max_positions:
                raise ValueError(f"length {length} exceeds the model's {self.max_positions} positions")
            prompt = length - self.max_new_tokens
            for i in range(self.num_samples):
                recipe = {"kind": self.kind, "length": prompt, "seed": seed * 1_000_003 + length * 101 + i}
                out.append(Sample(
                    id=f"{self.name}-{length}-{i}",
                    task=self.name,
                    context="",
                    turns=[Turn(question="", answers=[], max_new_tokens=self.max_new_tokens, metric="none")],
                    chat_template=False,
                    token_prompt=recipe,
                    # every sample decodes exactly max_new_tokens (an early EOS would shorten the timed decode)
                    meta={"seq_len": length, "synthetic": self.kind, "min_new_tokens": self.max_new_tokens},
                ))
        return out
