"""SCBench (Li et al., ICLR 2025): shared-context, multi-turn and multi-request long-context tasks.

Reimplements the prompt protocol of the released harness (microsoft/MInference `scbench/eval_utils.py`,
`run_scbench.py`, `args.py`) with `--use_chat_template`, which every released run script passes and which
RocketKV (the only one of the five papers on SCBench) follows with Llama-3.1-8B-Instruct. Scorers live in
`kvbench.tasks.scbench_metrics`.

Data: one row per shared context, `{id, context, multi_turns: [{input, answer, options?, task?, name?}], repo?,
lang?}`, read from `<data_dir>/scbench_<task>.jsonl` (the `data/` folder of the HF dataset `microsoft/SCBench`) or,
with `data_dir` null, through `load_dataset("microsoft/SCBench", "scbench_<task>",
split="test")` (the Hub, or its cache when offline). Rows are taken in file order; `num_samples` keeps the first N of each task (the reference's
`--num_eval_examples`); `max_turns` keeps the first turns of every row (reference default 5).

The 12 tasks (rows in the release, max new tokens per turn, metric):

| task                         | category      | rows | max new tokens           | metric                     |
| ---------------------------- | ------------- | ---- | ------------------------ | -------------------------- |
| scbench_kv                   | Retr.String   | 100  | 150                      | scbench_substring          |
| scbench_prefix_suffix        | Retr.String   | 100  | 150                      | scbench_substring          |
| scbench_vt                   | Retr.String   | 90   | 30                       | scbench_string_match_all   |
| scbench_repoqa               | Retr.Semantic | 88   | 1024                     | scbench_repoqa_<lang>      |
| scbench_qa_eng               | Retr.Semantic | 69   | 40                       | scbench_upper_substring    |
| scbench_qa_chn               | Retr.Semantic | 35   | 40                       | scbench_qa_f1_chars        |
| scbench_choice_eng           | Retr.Semantic | 58   | 40                       | scbench_choice             |
| scbench_many_shot            | Global        | 54   | 10                       | scbench_upper_substring    |
| scbench_summary              | Global        | 70   | 200                      | scbench_rouge_lsum         |
| scbench_mf                   | Global        | 100  | 5                        | scbench_math_find          |
| scbench_summary_with_needles | Multi-task    | 70   | summary 800 / passkey 15 | rouge_lsum / first_int     |
| scbench_repoqa_and_kv        | Multi-task    | 88   | repoqa 1024 / kv 80      | repoqa_<lang> / substring  |

Prompt layout (a `Sample` is one shared context; the user message of a request is `context + question`, plain
concatenation, separators included in the strings below):

- `mode: multi_turn` (SCBench default). Turn 1 is the task template with the context and the first query, in
  one user message: `context = <instruction> + <context>`, `question = "\\n\\n" + <query 1>`. Every later turn
  is a new user message `<query i>` after an assistant message holding the previous turn's gold answer
  (`meta["golden_answers"][i-1]`, "golden context"), on the same cache. Follow-up queries are the reference's
  chat-template follow-ups (`multiturn_follow_up_templates_in_chat_tempate`). Turns ≥ 2 of `scbench_summary`
  carry the answer prefix "This paper" after the assistant header (reference quirk; the prediction is what the
  model generates after it).
- `mode: multi_request` (the reference's `--same_context_different_query`). The context is shared; each query
  is an independent request whose user message is `context + <query i>` with no history and no separator
  between them (in the reference the context part ends where the query part begins, e.g. `...}Question: ...`).

Reference quirks reproduced on purpose (the published numbers were produced with them):
- choice_eng queries end with "The the correct answer is".
- mf: turn 1 prefixes the context with "What is <target of query 1>?"; in multi-turn chat mode every follow-up
  is prefixed with the target of the *last* kept turn (a leaked loop variable in `create_multiturn_prompt`);
  in multi-request mode the context is prefixed with the whole first query and each query with its own target.
- mf contexts are lists of integers rendered with Python's `str(list)`, as `str.format` does in the reference;
  golden answers are `str(answer)` (so a list answer, e.g. vt, appears as its Python repr).

Truncation (engine side): the reference tokenizes the whole first-turn prompt (chat template included) and,
if longer than `max_seq_length - reserve`, keeps its first and last `(max_seq_length - reserve) // 2` tokens;
`reserve` = max_new_tokens x turns (mixed tasks: sum of both sub-task limits x turns // 2), plus 1000 in
multi-request mode. Both numbers are in `meta`. Generation stops at the model's EOS tokens or the turn's limit.

Aggregation (report side): every turn is scored on its own; a task score is the mean over its turns, and for the
two mixed tasks the mean per sub-task (`meta["turn_tasks"]`). RocketKV's categories (`meta["category"]`) are
plain means of their tasks; its "Avg." is the sum of the 12 task scores divided by 11 (a quirk of its summary
script), so report a plain mean beside it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from kvbench.tasks.base import PromptMeter, Sample, Task, Turn, check_data_file, jsonl_or_hub_rows
from kvbench.tasks.scbench_metrics import REPOQA_LANGUAGES

HF_DATASET = "microsoft/SCBench"
MODES = ("multi_turn", "multi_request")
# The reference harness's --max_seq_length default; RocketKV used 127,500 for Llama-3.1-8B-Instruct.
DEFAULT_MAX_SEQ_LENGTH = 100_000
# Extra prompt budget the reference leaves in multi-request mode (`max_input_length -= 1000`).
MULTI_REQUEST_EXTRA_RESERVE = 1000

_KV_INSTRUCTION = "Extract the value corresponding to the specified key in the JSON object below.\n\n"
_REPOQA_INSTRUCTION = (
    "Based on the function description and code context, please retrieve and repeat the exact described "
    "function from the code context in a code block wrapped by ```:\n\n"
)
_CHOICE_INSTRUCTION = "Read the book and answer the question.\n\n"
_QA_ENG_INSTRUCTION = "Read the book and answer the question. Be very concise in your answer.\n\n"
_QA_CHN_INSTRUCTION = "阅读以下书籍然后回答问题。\n\n"
_SUMMARY_FOLLOW_UP_PREFIX = "This paper"

# Metric of a turn, keyed by the turn's sub-task (the task itself, or `turn["task"]` in the mixed tasks).
SUBTASK_METRIC = {
    "scbench_kv": "scbench_substring",
    "scbench_prefix_suffix": "scbench_substring",
    "scbench_vt": "scbench_string_match_all",
    "scbench_repoqa": "scbench_repoqa_{lang}",
    "scbench_qa_eng": "scbench_upper_substring",
    "scbench_qa_chn": "scbench_qa_f1_chars",
    "scbench_choice_eng": "scbench_choice",
    "scbench_many_shot": "scbench_upper_substring",
    "scbench_summary": "scbench_rouge_lsum",
    "scbench_mf": "scbench_math_find",
    "scbench_passkey": "scbench_first_int",
}


@dataclass(frozen=True)
class TaskSpec:
    """Protocol facts of one SCBench task."""

    category: str  # RocketKV Tab. 4 column
    instruction: str  # text before the context in the first user message
    query_style: str  # how a turn's query is written: input | choice | qa_eng | qa_chn | math_find
    max_new_tokens: dict[str, int]  # per turn sub-task (`DATA_NAME_TO_MAX_NEW_TOKENS`)


TASKS: dict[str, TaskSpec] = {
    "scbench_kv": TaskSpec("Retr.String", _KV_INSTRUCTION, "input", {"scbench_kv": 150}),
    "scbench_prefix_suffix": TaskSpec("Retr.String", "", "input", {"scbench_prefix_suffix": 150}),
    "scbench_vt": TaskSpec("Retr.String", "", "input", {"scbench_vt": 30}),
    "scbench_repoqa": TaskSpec("Retr.Semantic", _REPOQA_INSTRUCTION, "input", {"scbench_repoqa": 1024}),
    "scbench_qa_eng": TaskSpec("Retr.Semantic", _QA_ENG_INSTRUCTION, "qa_eng", {"scbench_qa_eng": 40}),
    "scbench_qa_chn": TaskSpec("Retr.Semantic", _QA_CHN_INSTRUCTION, "qa_chn", {"scbench_qa_chn": 40}),
    "scbench_choice_eng": TaskSpec("Retr.Semantic", _CHOICE_INSTRUCTION, "choice", {"scbench_choice_eng": 40}),
    "scbench_many_shot": TaskSpec("Global", "", "input", {"scbench_many_shot": 10}),
    "scbench_summary": TaskSpec("Global", "", "input", {"scbench_summary": 200}),
    "scbench_mf": TaskSpec("Global", "", "math_find", {"scbench_mf": 5}),
    "scbench_summary_with_needles": TaskSpec(
        "Multi-task", "", "input", {"scbench_summary": 800, "scbench_passkey": 15}
    ),
    "scbench_repoqa_and_kv": TaskSpec("Multi-task", "", "input", {"scbench_repoqa": 1024, "scbench_kv": 80}),
}


def load_rows(task: str, data_dir: str | None) -> list[dict[str, Any]]:
    """All rows of one SCBench task, from `data_dir` when given, else from the Hugging Face Hub (or its cache)."""
    path = None if data_dir is None else Path(data_dir) / f"{task}.jsonl"
    return jsonl_or_hub_rows(path, HF_DATASET, task, f"SCBench data for {task}", _how_to_get(task))


def _how_to_get(task: str) -> str:
    return (
        f"Get it on a machine with Hub access, then either\n"
        f"  huggingface-cli download {HF_DATASET} data/{task}.jsonl --repo-type dataset --local-dir DIR\n"
        f"  (then set task.data_dir=DIR/data), or\n"
        f"  wget https://huggingface.co/datasets/{HF_DATASET}/resolve/main/data/{task}.jsonl -O DIR/{task}.jsonl\n"
        f"  (then set task.data_dir=DIR), or fill the HF cache with\n"
        f"  python -c \"from datasets import load_dataset; load_dataset('{HF_DATASET}', '{task}', split='test')\"\n"
        f"  and leave task.data_dir null.")


def _math_find_target(query: str) -> str:
    # The reference takes the first greedy match of "The .+ is", lower-cased, without the trailing " is".
    found = re.findall(r"The .+ is", query)
    if not found:
        raise ValueError(f"scbench_mf query without a 'The ... is' target: {query!r}")
    return found[0].lower()[:-3]


def _query(style: str, turn: dict[str, Any]) -> str:
    """A turn's query as written in a follow-up / multi-request message (no leading separator)."""
    text = turn["input"]
    if style == "choice":
        a, b, c, d = turn["options"]
        return f"Question: {text}\nA. {a}\nB. {b}\nC. {c}\nD. {d}\n\nThe the correct answer is"
    if style == "qa_eng":
        return f"Question: {text}\nAnswer:"
    if style == "qa_chn":
        return f"问题：{text}\n答案："
    if style == "math_find":
        return f"What is {_math_find_target(text)}?\n\n{text}"
    return text


def _answers(subtask: str, turn: dict[str, Any], repo_needles: list[str]) -> list[str]:
    """Gold strings handed to the turn's scorer (see `kvbench.tasks.scbench_metrics`)."""
    answer = turn["answer"]
    if subtask == "scbench_choice_eng":
        # The reference scores against [option text, option letter].
        return [answer, "ABCD"[turn["options"].index(answer)]]
    if subtask == "scbench_repoqa":
        return [answer, *repo_needles]
    if isinstance(answer, list):
        return [str(a) for a in answer]
    return [str(answer)]


class SCBench(Task):
    """One or several SCBench tasks (`tasks`), as `Sample`s with one `Turn` per query.

    Args:
        name: run label (`scbench_kv` for one task, `scbench` for the suite).
        tasks: SCBench task names (keys of `TASKS`); each sample's `Sample.task` is its task name.
        seq_len: must be null: SCBench is fixed real data (lengths come from the rows).
        num_samples: first N rows of each task; null = all.
        data_dir: folder with `scbench_<task>.jsonl`; null = the Hugging Face Hub (or its cache).
        mode: `multi_turn` (golden-context session on one cache) or `multi_request` (independent queries on the
            shared context).
        max_turns: keep the first N turns of every row (reference default 5); null or <= 0 = all.
        golden_context: multi-turn history holds the gold answers (SCBench default); false = the model's own
            replies (the reference's --disable_golden_context), which the engine implements.
        max_seq_length: the reference's --max_seq_length, the token limit the first-turn prompt is truncated to
            after subtracting the generation reserve.
    """

    def __init__(
        self,
        name: str,
        tasks: Sequence[str],
        seq_len: int | None = None,
        num_samples: int | None = None,
        data_dir: str | None = None,
        mode: str = "multi_turn",
        max_turns: int | None = 5,
        golden_context: bool = True,
        max_seq_length: int = DEFAULT_MAX_SEQ_LENGTH,
    ) -> None:
        if seq_len is not None:
            raise ValueError("SCBench is real data with fixed lengths: task.seq_len must be null")
        if not tasks:
            raise ValueError(f"tasks is empty; give at least one of {', '.join(TASKS)}")
        unknown = [t for t in tasks if t not in TASKS]
        if unknown:
            raise ValueError(f"unknown SCBench task(s) {unknown}; known: {', '.join(TASKS)}")
        if mode not in MODES:
            raise ValueError(f"SCBench mode must be one of {MODES}, got {mode!r}")
        self.name = name
        self.tasks = [str(t) for t in tasks]
        self.num_samples = num_samples
        self.data_dir = data_dir
        self.mode = mode
        self.max_turns = max_turns if max_turns is not None and max_turns > 0 else None
        self.golden_context = golden_context
        self.max_seq_length = max_seq_length

    def check(self) -> None:
        """A `data_dir` without a task's file, before the model loads (the Hub is asked later)."""
        for task in self.tasks if self.data_dir is not None else ():
            check_data_file(Path(self.data_dir) / f"{task}.jsonl", f"SCBench data for {task}", _how_to_get(task))

    def samples(self, meter: PromptMeter, seed: int) -> list[Sample]:
        """All samples of the configured tasks, in data order. Deterministic: `seed` and `meter` are unused
        (nothing is sampled or sized; truncation is the engine's, by tokens of the evaluated model)."""
        out: list[Sample] = []
        for task in self.tasks:
            rows = load_rows(task, self.data_dir)
            if self.num_samples is not None:
                rows = rows[: self.num_samples]
            rows = [{**row, "multi_turns": row["multi_turns"][: self.max_turns]} for row in rows]
            out.extend(self._task_samples(task, rows))
        return out

    def _reserve(self, spec: TaskSpec, num_turns: int) -> int:
        # run_scbench.py: max_input_length = max_seq_length - reserve, turns counted on the first row.
        limits = list(spec.max_new_tokens.values())
        reserve = limits[0] * num_turns if len(limits) == 1 else sum(limits) * num_turns // 2
        return reserve + (MULTI_REQUEST_EXTRA_RESERVE if self.mode == "multi_request" else 0)

    def _task_samples(self, task: str, rows: list[dict[str, Any]]) -> list[Sample]:
        spec = TASKS[task]
        if not rows:
            return []
        reserve = self._reserve(spec, len(rows[0]["multi_turns"]))

        def subtask(turn: dict[str, Any]) -> str:
            return turn.get("task") or task

        # RepoQA compares an answer with every needle function of its repository over all evaluated rows and
        # turns (`needle_by_repo` in compute_scores.py), so the pool depends on the selection made above.
        repo_needles: dict[str, list[str]] = {}
        for row in rows:
            for turn in row["multi_turns"]:
                if subtask(turn) == "scbench_repoqa":
                    if row.get("lang") not in REPOQA_LANGUAGES:
                        raise ValueError(f"{task} row {row.get('id')}: RepoQA language {row.get('lang')!r} unknown")
                    pool = repo_needles.setdefault(row["repo"], [])
                    if turn["answer"] not in pool:
                        pool.append(turn["answer"])

        samples = []
        for index, row in enumerate(rows):
            raw_context = row["context"] if "context" in row else row["input"]
            context_text = raw_context if isinstance(raw_context, str) else str(raw_context)
            turns_raw = row["multi_turns"]
            queries = [_query(spec.query_style, t) for t in turns_raw]
            context, questions = self._layout(spec, context_text, turns_raw, queries)

            turns = []
            for i, (turn, question) in enumerate(zip(turns_raw, questions)):
                sub = subtask(turn)
                metric = SUBTASK_METRIC[sub].format(lang=row.get("lang"))
                prefix = (
                    _SUMMARY_FOLLOW_UP_PREFIX
                    if task == "scbench_summary" and self.mode == "multi_turn" and i > 0
                    else ""
                )
                turns.append(
                    Turn(
                        question=question,
                        answers=_answers(sub, turn, repo_needles.get(row.get("repo"), [])),
                        max_new_tokens=spec.max_new_tokens[sub],
                        metric=metric,
                        answer_prefix=prefix,
                    )
                )

            meta: dict[str, Any] = {
                "benchmark": "scbench",
                "category": spec.category,
                "record_id": row.get("id", index),
                "mode": self.mode,
                "golden_context": self.golden_context,
                "golden_answers": [str(t["answer"]) for t in turns_raw],
                "turn_tasks": [subtask(t) for t in turns_raw],
                "max_seq_length": self.max_seq_length,
                "reserve_tokens": reserve,
                "prompt_token_limit": self.max_seq_length - reserve,
            }
            for key in ("repo", "lang"):
                if row.get(key) is not None:
                    meta[key] = row[key]
            samples.append(
                Sample(
                    id=f"{task}/{index}",
                    task=task,
                    context=context,
                    turns=turns,
                    chat_template=True,
                    truncation="middle",
                    meta=meta,
                )
            )
        return samples

    def _layout(
        self,
        spec: TaskSpec,
        context_text: str,
        turns: list[dict[str, Any]],
        queries: list[str],
    ) -> tuple[str, list[str]]:
        """(context part, per-turn question) for the configured mode."""
        if self.mode == "multi_request":
            if spec.query_style == "math_find":
                # create_scdq_prompt: the context is prefixed with the whole first query.
                return f"{turns[0]['input']}\n\n{context_text}", queries
            return spec.instruction + context_text, queries
        if spec.query_style == "math_find":
            first_target = _math_find_target(turns[0]["input"])
            last_target = _math_find_target(turns[-1]["input"])
            context = f"What is {first_target}?\n\n{context_text}"
            follow_ups = [f"What is {last_target}?\n\n{t['input']}" for t in turns[1:]]
            return context, ["\n\n" + turns[0]["input"], *follow_ups]
        return spec.instruction + context_text, ["\n\n" + queries[0], *queries[1:]]
