"""Prompt building: the chat template split into context and question ids (the same tokens in both
compression modes), multi-turn histories with gold answers, prompt limits and stop tokens."""

from __future__ import annotations

from typing import Any

import torch

from kvbench.core.errors import KVBenchError
from kvbench.models import LoadedModel
from kvbench.tasks.base import Sample

_SPLIT = "\ue000kvbench-split\ue000"  # a private-use marker: chat templates leave it alone


class PromptBuilder:
    """Token ids of each prompt part, with the model's chat template when the sample asks for it.

    Both modes see the same token sequence: the context part and the question part are tokenized
    separately, so question-agnostic and question-aware runs differ only in where compression happens.
    """

    def __init__(self, tokenizer: Any, use_chat_template: bool = True, system_prompt: str | None = None):
        self.tokenizer = tokenizer
        self.use_chat_template = use_chat_template and getattr(tokenizer, "chat_template", None) is not None
        self.system_prompt = system_prompt

    def _templated(self, sample_chat: bool) -> bool:
        return self.use_chat_template and sample_chat

    def _render(self, messages: list[dict[str, str]]) -> str:
        if self.system_prompt is not None:
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def _ids(self, text: str, first: bool) -> list[int]:
        return self.tokenizer(text, add_special_tokens=first, return_attention_mask=False)["input_ids"]

    def split_texts(self, context: str, question: str, answer_prefix: str, chat: bool) -> tuple[str, str]:
        if not self._templated(chat):
            return context, question + answer_prefix
        text = self._render([{"role": "user", "content": context + _SPLIT + question}]) + answer_prefix
        head, tail = text.split(_SPLIT)
        return head, tail

    def first_turn(self, sample: Sample) -> tuple[list[int], list[int]]:
        if sample.token_prompt is not None:
            return self.token_prompt_ids(sample.token_prompt), []
        turn = sample.turns[0]
        head, tail = self.split_texts(sample.context, turn.question, turn.answer_prefix, sample.chat_template)
        templated = self._templated(sample.chat_template)
        return self._ids(head, first=not templated), self._ids(tail, first=False)

    def evidence_positions(self, sample: Sample) -> tuple[int, int] | None:
        """Prompt positions [start, end) of the context span that a task says holds the answer: a NIAH needle
        (`needle_char_offset` .. `needle_char_end`), a RULER answer (`answer_char_offset` + the first answer);
        None where the task does not say. Counted as the tokens of the prompt's head up to each end (the leading
        space that joins the span's first token is left out of the start)."""
        meta, turn = sample.meta, sample.turns[0] if sample.turns else None
        if sample.token_prompt is not None or turn is None:
            return None
        if "needle_char_offset" in meta and "needle_char_end" in meta:
            start, end = int(meta["needle_char_offset"]), int(meta["needle_char_end"])
        elif "answer_char_offset" in meta and turn.answers and int(meta["answer_char_offset"]) >= 0:
            start = int(meta["answer_char_offset"])
            end = start + len(str(turn.answers[0]))
        else:
            return None
        first = not self._templated(sample.chat_template)

        def tokens(upto: str) -> int:
            head, _ = self.split_texts(upto, turn.question, turn.answer_prefix, sample.chat_template)
            return len(self._ids(head, first=first))

        return tokens(sample.context[:start].rstrip()), tokens(sample.context[:end])

    def token_prompt_ids(self, recipe: dict[str, Any]) -> list[int]:
        """Token ids from a synthetic recipe: `length` ordinary tokens (no special ones), uniformly random or
        one token repeated, drawn with the recipe's seed."""
        special = set(self.tokenizer.all_special_ids)
        ordinary = torch.tensor([i for i in range(len(self.tokenizer)) if i not in special])
        gen = torch.Generator().manual_seed(int(recipe["seed"]))
        count = recipe["length"] if recipe["kind"] == "random" else 1
        ids = ordinary[torch.randint(len(ordinary), (count,), generator=gen)].tolist()
        return ids if recipe["kind"] == "random" else ids * recipe["length"]

    def measure(self, context: str, question: str = "", answer_prefix: str = "", chat_template: bool = True) -> int:
        head, tail = self.split_texts(context, question, answer_prefix, chat_template)
        return len(self._ids(head, first=not self._templated(chat_template))) + len(self._ids(tail, first=False))

    def history_text(self, sample: Sample, upto: int) -> str:
        """The rendered prompt through turn `upto` (0-based), gold answers standing in for earlier replies.

        The cache is rolled back to the end of turn t's prompt (its answer prefix included) before turn t+1,
        so the gold answer continues that prefix exactly as a model reply would have.
        """
        turns = sample.turns
        if not self._templated(sample.chat_template):
            text = sample.context + turns[0].question + turns[0].answer_prefix
            for t in range(1, upto + 1):
                text += history_answer(sample, t - 1) + "\n\n" + turns[t].question + turns[t].answer_prefix
            return text
        messages = [{"role": "user", "content": sample.context + turns[0].question}]
        for t in range(1, upto + 1):
            prev = turns[t - 1]
            messages.append({"role": "assistant", "content": prev.answer_prefix + history_answer(sample, t - 1)})
            messages.append({"role": "user", "content": turns[t].question})
        return self._render(messages) + turns[upto].answer_prefix

    def next_turn(self, sample: Sample, t: int) -> list[int]:
        before, after = self.history_text(sample, t - 1), self.history_text(sample, t)
        if not after.startswith(before):
            raise KVBenchError("the chat template renders earlier turns differently once a turn is added")
        return self._ids(after[len(before):], first=False)

    def request(self, sample: Sample, t: int) -> list[int]:
        """Turn t as an independent request on the cached context (multi-request mode)."""
        turn = sample.turns[t]
        _, tail = self.split_texts("", turn.question, turn.answer_prefix, sample.chat_template)
        return self._ids(tail, first=False)


def continuation(answer: str, answer_prefix: str) -> str:
    """`answer` as the model would continue `answer_prefix`: a space after a word."""
    if answer_prefix and not answer_prefix[-1].isspace() and not answer[:1].isspace():
        return " " + answer
    return answer


def gold_continuation(turn: Any) -> str:
    """The first gold answer continuing the turn's answer prefix (the teacher-forcing target)."""
    return continuation(turn.answers[0] if turn.answers else "", turn.answer_prefix)


def history_answer(sample: Sample, t: int) -> str:
    """What stands in for the model's reply to turn t in the next turn's history (golden context).

    A task may give the exact string its reference inserts (`meta["golden_answers"]`, e.g. SCBench's
    `str(answer)`); otherwise the first gold answer.
    """
    golden = sample.meta.get("golden_answers")
    if golden is not None:
        return continuation(golden[t], sample.turns[t].answer_prefix)
    return gold_continuation(sample.turns[t])




def stop_token_ids(lm: LoadedModel) -> set[int]:
    ids: set[int] = set()
    for source in (lm.tokenizer.eos_token_id, getattr(lm.model.generation_config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(int(i) for i in source)
    return ids


def _truncate_middle(ids: list[int], keep: int) -> list[int]:
    half = keep // 2
    return ids[:half] + ids[len(ids) - (keep - half):]


def fit_to_model(lm: LoadedModel, sample: Sample, ctx_ids: list[int], q_ids: list[int]) -> list[int]:
    """Enforce the prompt limits: middle-truncate the context (LongBench, SCBench) or refuse.

    The limit is the model's positions minus the tokens to generate, and the task's own cap on the first
    prompt (`meta["prompt_token_limit"]`, e.g. SCBench's max_seq_length minus its reserve) when it has one.
    """
    new_tokens = sum(t.max_new_tokens for t in sample.turns)
    limit = lm.max_positions - new_tokens
    if sample.meta.get("prompt_token_limit"):
        limit = min(limit, int(sample.meta["prompt_token_limit"]))
    prompt = len(ctx_ids) + len(q_ids)
    if prompt <= limit:
        return ctx_ids
    if sample.truncation == "middle" and limit > len(q_ids):
        return _truncate_middle(ctx_ids, limit - len(q_ids))
    raise KVBenchError(
        f"sample {sample.id}: {prompt} prompt tokens + {new_tokens} new tokens exceed the limit of "
        f"{lm.max_positions} positions of {lm.name}; lower task.seq_len"
    )
