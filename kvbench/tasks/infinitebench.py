"""InfiniteBench (Zhang et al., ACL 2024): the 12 tasks, their prompts, generation lengths and official scorers, as
OmniKV runs them (Tables 2, 3, 7: inputs middle-truncated to 128K tokens, En.Sum sampled with top-p 0.95 / T 0.8).

Protocol, following OpenBMB/InfiniteBench (`src/eval_utils.py`, `src/prompt.py`, `src/eval_yarn_mistral.py`,
`src/compute_scores.py`, `data/construct_synthetic_dataset.py`, commit 88b3daa) and OmniKV's copy of it
(antgroup/OmniKV `benchmark/infinite_bench/src/eval_any_my_model.py`):

- Prompt = `create_prompt(eg, task, model)` with the open-model templates (`yarn_mistral_templates`, which the
  benchmark maps its Yi, ChatGLM and Mistral runs to; OmniKV's copy of `eval_utils.py` has no other template for
  open models, so its runs must have used these too, though its run commands are not released: inferred). Code.Run's `{func}` and
  `{func_call}` come from the row's input (`func_[0-9]+\\(-?[0-9]+\\)`), Math.Find's prefix from its "The ... of"
  phrase, the options of En.MC and Code.Debug from `options`.
- Three parts: the context part is the template through `{context}`, the question part the rest (it ends with the
  template's cue, "The pass key is", "Answer:", ...); context + question is the official prompt string. The prompt
  goes in raw (`chat_template: false`), as the benchmark's open-model scripts feed it.
- `max_new_tokens` = `DATA_NAME_TO_MAX_NEW_TOKENS`; labels = `get_answer` (En.MC and Code.Debug: [option text,
  letter]); each turn's metric is the task's official scorer (`kvbench.tasks.infinitebench_metrics`), the label
  passed as `metric_args["label"]` so numbers stay numbers.
- Truncation: prompts longer than `truncate_to` (128 x 1024, the benchmark's and OmniKV's `TRUNCATE_LEN`) keep
  their head and tail (`Sample.truncation = "middle"`, `meta["prompt_token_limit"]`). Departure: the benchmark cuts
  the whole prompt in tokens (first half, last half); kvbench's engine cuts the context part and keeps the question
  whole, so the head is shorter and the tail longer by half the question's tokens (a few dozen of 131072).
  The cap is min(`truncate_to`, the model's positions - the task's tokens to generate) (`engine.prompt.fit_to_model`),
  so prompt and answer fit the model's positions. Departure: the benchmark cuts at 131072 whatever the model, so on
  a model with 131072 positions (Llama-3.1) kvbench keeps fewer tokens than the release (En.QA, 40 tokens to
  generate: 131032 where the release keeps 131072 and generates past the model's positions); docs/fidelity.md.
- En.Sum: OmniKV samples it (`temperature=0.8, top_p=0.95, do_sample=True`, greedy elsewhere): `meta["sampling"]`
  holds these with a per-sample seed drawn from `sample_rng(seed, name, subset, row id)`.

Data: `<task>.jsonl` of the HF dataset xinrongzhang2022/InfiniteBench (the benchmark's `scripts/download_dataset.sh`)
in `data_dir` (or `data_dir/data`), else the file from the Hugging Face Hub or its cache (`huggingface_hub`, the raw
JSONL rows the benchmark's `iter_jsonl` reads: `datasets` would cast the 12 files' different `answer` types).

Generated retrieval (`seq_len` set): Retrieve.PassKey, Retrieve.Number and Retrieve.KV are built offline the way
`construct_synthetic_dataset.py` builds them, sized to `seq_len` tokens (prompt + tokens to generate, through the
engine's meter) instead of the script's fixed noise counts:

- passkey / number_string: the noise line ("The grass is green. ...") n times, the needle line ("The pass key is
  {key}. Remember it. {key} is the pass key.") after j of them; the key is 5 random digits (number_string: then 5
  times a digit is repeated in place, `keys.insert(pos, keys[pos])`, 10 digits). n is the largest that fits.
- kv_retrieval: "JSON data:\\n{" + `"key": "value", ` pairs + "}" of m random UUID4 pairs (the script reads its
  pairs from a file of UUID4 strings), the asked key at index `int(i * m / N)`; m is the largest that fits.
- Depth: the script sweeps the needle from the start to the end in fixed steps, 5 keys per depth (10 for
  number_string); here sample i of N puts it after round(i * n / (N - 1)) noise lines (N = 1: the middle), one key
  per depth, so a small N still spans the context. Every sample draws from `sample_rng(seed, name, subset,
  seq_len, i)` (the script uses the global `random`).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvbench.tasks.base import (
    DatasetMissingError,
    PromptMeter,
    Sample,
    Task,
    Turn,
    read_jsonl,
    sample_rng,
    subset_files,
)

HF_REPO = "xinrongzhang2022/InfiniteBench"

# The benchmark's `ALL_TASKS` order; the paper names are InfiniteBench's (and OmniKV's table headers).
PAPER_NAMES = {
    "passkey": "Retr.PassKey",
    "number_string": "Retr.Number",
    "kv_retrieval": "Retr.KV",
    "longdialogue_qa_eng": "En.Dia",
    "longbook_sum_eng": "En.Sum",
    "longbook_choice_eng": "En.MC",
    "longbook_qa_eng": "En.QA",
    "longbook_qa_chn": "Zh.QA",
    "math_find": "Math.Find",
    "math_calc": "Math.Calc",
    "code_run": "Code.Run",
    "code_debug": "Code.Debug",
}
ALL_SUBSETS = tuple(PAPER_NAMES)
# OmniKV Table 2 / 3 / 7: every task but Code.Run and Math.Calc.
OMNIKV_SUBSETS = ("longbook_sum_eng", "longbook_qa_eng", "longbook_choice_eng", "longdialogue_qa_eng",
                  "longbook_qa_chn", "code_debug", "math_find", "passkey", "number_string", "kv_retrieval")
GENERATED_SUBSETS = ("passkey", "number_string", "kv_retrieval")

# src/eval_utils.py DATA_NAME_TO_MAX_NEW_TOKENS
MAX_NEW_TOKENS = {
    "passkey": 6, "number_string": 12, "kv_retrieval": 50, "longbook_sum_eng": 1200, "longbook_choice_eng": 40,
    "longbook_qa_eng": 40, "longbook_qa_chn": 40, "longdialogue_qa_eng": 40, "math_find": 3, "math_calc": 30000,
    "code_run": 5, "code_debug": 5,
}  # fmt: skip

# src/prompt.py yarn_mistral_templates, verbatim.
TEMPLATES = {
    "passkey": "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. I will quiz you about the important information.\n\n{context}\n\n{input}\n\nThe pass key is",  # noqa: E501
    "number_string": "There is an important info hidden inside a lot of irrelevant text. Find it. I will quiz you about the important information there.\n\n{context}\n\n{input}\n\nThe sequence of digits is",  # noqa: E501
    "kv_retrieval": "Extract the value corresponding to the specified key in the JSON object below.\n\n{context}\n\n{input}",  # noqa: E501
    "longbook_sum_eng": "Summarize the book below.\n\n{context}\n\nSummary:",
    "longbook_choice_eng": "Read the book and answer the question.\n\n{context}\n\nQuestion: {question}\nA. {OPTION_A}\nB. {OPTION_B}\nC. {OPTION_C}\nD. {OPTION_D}\n\nThe letter of the correct answer is",  # noqa: E501
    "longbook_qa_eng": "Read the book and answer the question. Be very concise in your answer.\n\n{context}\n\nQuestion: {question}\nAnswer:",  # noqa: E501
    "longbook_qa_chn": "阅读以下书籍然后回答问题。\n\n{context}\n\n问题：{question}\n答案：",
    "math_find": "{prefix}\n\n{context}\n\n{input}",
    "math_calc": "Let us calculate the intermediate values of an expression.\n\nExpression: 1 + 3 + 4\nValues: [1, 4, 8]\n\nExpression: 8 - 3 + 2 - 4\nValues: [8, 5, 7, 3]\n\nExpression: {context}\nValues:",  # noqa: E501
    "code_run": "There is a function called {func} in the following Python code.\n\n{context}\n\nPlease compute the exact value of {func_call}. The value of {func_call} is",  # noqa: E501
    "code_debug": "Following is a Python code where exactly one of the functions/methods has a deliberate error that makes it crash.\n\n{context}\n\nOptions:\nA. {OPTION_A}\nB. {OPTION_B}\nC. {OPTION_C}\nD. {OPTION_D}\n\nThe correct option is:",  # noqa: E501
    "longdialogue_qa_eng": "Below is a dialogue script where one random occurrence of a character name is replaced with \"$$MASK$$\", and you should try to guess who that character is.\n\n{context}\n\nThe name that has been replaced with $$MASK$$ is likely",  # noqa: E501
}

# data/construct_synthetic_dataset.py
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"
PASSKEY_NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key.\n"
PASSKEY_QUESTION = "What is the pass key?"
NUMBER_NEEDLE = "The sequence of digits is {key}. Remember it. {key} is the sequence of digits.\n"
NUMBER_QUESTION = "What is the sequence of digits?"
KV_QUESTION = "\nKey: \"{key}\"\nThe value associated with the specified key is: "

OPTION_LETTERS = "ABCD"


def split_template(subset: str) -> tuple[str, str]:
    """(context template, question template): the template through `{context}` and the rest."""
    template = TEMPLATES[subset]
    end = template.index("{context}") + len("{context}")
    return template[:end], template[end:]


def get_answer(row: dict[str, Any], subset: str) -> Any:
    """The official label (`eval_utils.get_answer`): [option text, letter] for En.MC and Code.Debug, else `answer`."""
    if subset in ("code_debug", "longbook_choice_eng"):
        answer = row["answer"]
        if isinstance(answer, str):
            return [answer, OPTION_LETTERS[row["options"].index(answer)]]
        if isinstance(answer, list) and len(answer) == 1:
            return [answer[0], OPTION_LETTERS[row["options"].index(answer[0])]]
        if isinstance(answer, list) and len(answer) == 2 and answer[1] in OPTION_LETTERS:
            return list(answer)
        raise ValueError(f"{subset}: cannot read the answer {answer!r} against the options")
    return row["answer"]


def format_fields(row: dict[str, Any], subset: str) -> dict[str, str]:
    """The template's fields for one row, as `create_prompt` fills them."""
    fields: dict[str, str] = {"context": row["context"]}
    if subset == "code_run":
        found = re.findall(r"func_[0-9]+\(\-?[0-9]+\)", row["input"])
        if not found:
            raise ValueError(f"code_run: no func_N(x) call in the input {row['input']!r}")
        fields.update(func=found[0].split("(")[0], func_call=found[0])
    elif subset == "math_find":
        found = re.findall(r"The .+ of", row["input"])
        if not found:
            raise ValueError(f"math_find: no 'The ... of' phrase in the input {row['input']!r}")
        fields.update(prefix=f"What is {found[0].lower()[:-3]} in the following list?", input=row["input"])
    elif subset in ("code_debug", "longbook_choice_eng"):
        fields.update({f"OPTION_{letter}": row["options"][i] for i, letter in enumerate(OPTION_LETTERS)})
        if subset == "longbook_choice_eng":
            fields["question"] = row["input"]
    elif subset in ("longbook_qa_eng", "longbook_qa_chn"):
        fields["question"] = row["input"]
    elif subset in ("passkey", "number_string", "kv_retrieval"):
        fields["input"] = row["input"]
    return fields


def _answers_as_strings(label: Any) -> list[str]:
    values = label if isinstance(label, list) else [label]
    return [v if isinstance(v, str) else json.dumps(v) for v in values]


def _missing_message(names: Sequence[str], where: str) -> str:
    files = " ".join(names)
    return (
        f"InfiniteBench data ({HF_REPO}) not found for {', '.join(names)}: {where}.\n"
        "Get the files on a machine with internet access (the benchmark's scripts/download_dataset.sh):\n"
        f"  for f in {files}; do\n"
        f"    huggingface-cli download {HF_REPO} $f.jsonl --repo-type dataset --local-dir infinitebench\n"
        "  done\n"
        "then run with task.data_dir=/abs/path/to/infinitebench (or leave it null once the files are in the Hub cache;\n"
        "the retrieval tasks need no data with task.seq_len set: they are generated)"
    )


ROW_KEYS = ("context", "answer")  # what every InfiniteBench row has


def _hub_file(subset: str) -> Path:
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(HF_REPO, f"{subset}.jsonl", repo_type="dataset"))
    except Exception as err:  # noqa: BLE001 - offline, not cached, no access: all mean "not here"
        raise DatasetMissingError(
            _missing_message([subset], f"task.data_dir is null and the Hub (or its cache) failed: {err}")
        ) from err


class InfiniteBench(Task):
    """InfiniteBench tasks (`subsets`, the benchmark's file names) as single-turn samples.

    Args:
        name: run label.
        subsets: which of the 12 tasks (`ALL_SUBSETS`); default OmniKV's 10 (`OMNIKV_SUBSETS`).
        num_samples: per task, the first N rows (real data) or N generated samples; null: every row (generated: 10).
        seq_len: null: every task reads its data. A number: the retrieval tasks (passkey, number_string,
            kv_retrieval) are generated at that many tokens (prompt + tokens to generate); the others still read data.
        data_dir: folder with `<task>.jsonl` (or `data/<task>.jsonl`); null: the Hugging Face Hub or its cache.
        truncate_to: the prompt token limit beyond which the middle is cut (128 x 1024: the benchmark's, OmniKV's).
        chat_template: wrap the prompt in the model's chat template (the benchmark's open-model runs do not).
        sum_temperature, sum_top_p: En.Sum's sampling (OmniKV: 0.8, 0.95), recorded in `meta["sampling"]`.
    """

    name = "infinitebench"

    def __init__(
        self,
        name: str = "infinitebench",
        subsets: Sequence[str] | None = None,
        num_samples: int | None = None,
        seq_len: int | None = None,
        data_dir: str | None = None,
        truncate_to: int = 128 * 1024,
        chat_template: bool = False,
        sum_temperature: float = 0.8,
        sum_top_p: float = 0.95,
    ) -> None:
        self.name = name
        self.subsets = list(subsets) if subsets is not None else list(OMNIKV_SUBSETS)
        bad = [s for s in self.subsets if s not in ALL_SUBSETS]
        if not self.subsets:
            raise ValueError(f"subsets is empty; give at least one of {list(ALL_SUBSETS)} (or null: the ten "
                             f"OmniKV evaluates)")
        if bad:
            raise ValueError(f"InfiniteBench subsets {bad} unknown; choose from {list(ALL_SUBSETS)}")
        if num_samples is not None and num_samples < 1:
            raise ValueError("num_samples must be >= 1 or null")
        if seq_len is not None and seq_len < 64:
            raise ValueError(f"seq_len must be at least 64 tokens to generate a retrieval task, got {seq_len}")
        if truncate_to < 1:
            raise ValueError(f"truncate_to must be a positive number of tokens, got {truncate_to}")
        if not (sum_temperature > 0 and 0 < sum_top_p <= 1):
            raise ValueError("sum_temperature must be > 0 and sum_top_p in (0, 1]")
        self.num_samples = num_samples
        self.seq_len = seq_len
        self.data_dir = Path(data_dir).expanduser() if data_dir is not None else None
        self.truncate_to = int(truncate_to)
        self.chat_template = bool(chat_template)
        self.sum_temperature = float(sum_temperature)
        self.sum_top_p = float(sum_top_p)

    # -- data ------------------------------------------------------------------------------------------------------
    def generated(self, subset: str) -> bool:
        return self.seq_len is not None and subset in GENERATED_SUBSETS

    def load_rows(self, subsets: Sequence[str]) -> dict[str, list[dict[str, Any]]]:
        """Raw rows per task, from `data_dir` (or `data_dir/data`) or else the Hub / its cache."""
        if not subsets:
            return {}
        if self.data_dir is None:
            return {s: read_jsonl(_hub_file(s), ROW_KEYS, "InfiniteBench") for s in subsets}
        paths = subset_files(self.data_dir, {s: s for s in subsets}, _missing_message)
        return {s: read_jsonl(p, ROW_KEYS, "InfiniteBench") for s, p in paths.items()}

    def check(self) -> None:
        """A `data_dir` without the read tasks' files, before the model loads (the Hub is asked later)."""
        read = [s for s in self.subsets if not self.generated(s)]
        if self.data_dir is not None and read:
            subset_files(self.data_dir, {s: s for s in read}, _missing_message)

    def samples(self, meter: PromptMeter, seed: int) -> list[Sample]:
        rows = self.load_rows([s for s in self.subsets if not self.generated(s)])
        out: list[Sample] = []
        for subset in self.subsets:
            if self.generated(subset):
                out.extend(self.generate(subset, meter, seed))
                continue
            chosen = rows[subset] if self.num_samples is None else rows[subset][: self.num_samples]
            out.extend(self.build_sample(subset, row, index, seed) for index, row in enumerate(chosen))
        return out

    def build_sample(self, subset: str, row: dict[str, Any], index: int, seed: int, meta: dict | None = None) -> Sample:
        """One sample from one row of the benchmark's JSONL (or a generated row of the same layout)."""
        context_t, question_t = split_template(subset)
        fields = format_fields(row, subset)
        label = get_answer(row, subset)
        source_id = row.get("id", index)
        task = f"infinitebench_{subset}"
        info: dict[str, Any] = {
            "benchmark": "infinitebench",
            "subset": subset,
            "paper_name": PAPER_NAMES[subset],
            "source_id": source_id,
            "prompt_token_limit": self.truncate_to,
            "generated": False,
            **(meta or {}),
        }
        if subset == "longbook_sum_eng":
            sampling_seed = sample_rng(seed, self.name, subset, source_id).getrandbits(63)
            info["sampling"] = {"temperature": self.sum_temperature, "top_p": self.sum_top_p, "seed": sampling_seed}
        return Sample(
            id=f"{task}/{source_id}",
            task=task,
            context=context_t.format(**fields),
            turns=[
                Turn(
                    question=question_t.format(**fields),
                    answers=_answers_as_strings(label),
                    max_new_tokens=MAX_NEW_TOKENS[subset],
                    metric=f"infinitebench_{subset}",
                    metric_args={"label": label},
                )
            ],
            chat_template=self.chat_template,
            truncation="middle",
            meta=info,
        )

    # -- generated retrieval ---------------------------------------------------------------------------------------
    def generate(self, subset: str, meter: PromptMeter, seed: int) -> list[Sample]:
        count = self.num_samples or 10
        return [self._generated_sample(subset, i, count, meter, seed) for i in range(count)]

    def _fits(self, subset: str, row: dict[str, Any], meter: PromptMeter) -> bool:
        context_t, question_t = split_template(subset)
        fields = format_fields(row, subset)
        tokens = meter(context_t.format(**fields), question_t.format(**fields), "", self.chat_template)
        return tokens + MAX_NEW_TOKENS[subset] <= self.seq_len

    def _largest_fitting(self, subset: str, build, upper: int, meter: PromptMeter) -> int:
        """The largest size in [0, upper] whose row fits `seq_len` (rows grow with the size); -1: none fits."""
        low, high = -1, upper
        while low < high:
            mid = (low + high + 1) // 2
            if self._fits(subset, build(mid), meter):
                low = mid
            else:
                high = mid - 1
        return low

    def _generated_sample(self, subset: str, i: int, count: int, meter: PromptMeter, seed: int) -> Sample:
        rng = sample_rng(seed, self.name, subset, self.seq_len, i)
        depth = i / (count - 1) if count > 1 else 0.5
        if subset == "kv_retrieval":
            pool = [(str(uuid.UUID(int=rng.getrandbits(128), version=4)), str(uuid.UUID(int=rng.getrandbits(128), version=4)))
                    for _ in range(self.seq_len // 2 + 1)]

            def build(m: int) -> dict[str, Any]:
                m = max(m, 1)
                asked = min(int(i * m / count), m - 1)
                text = "JSON data:\n{" + ", ".join(f'"{k}": "{v}"' for k, v in pool[:m]) + "}"
                return {"context": text, "input": KV_QUESTION.format(key=pool[asked][0]), "answer": pool[asked][1],
                        "id": i, "_pairs": m, "_asked": asked}

            size = self._largest_fitting(subset, build, len(pool), meter)
            if size < 1:
                raise ValueError(f"kv_retrieval: seq_len={self.seq_len} holds no key-value pair; raise task.seq_len")
            row = build(size)
            meta = {"generated": True, "seq_len": self.seq_len, "pairs": row["_pairs"], "depth": row["_asked"] / row["_pairs"]}
        else:
            digits = [str(rng.randint(0, 9)) for _ in range(5)]
            if subset == "number_string":  # five times, one digit is doubled in place
                for k in range(5):
                    pos = rng.randint(0, 5 + k - 1)
                    digits.insert(pos, digits[pos])
            key = "".join(digits)
            needle, question = (PASSKEY_NEEDLE, PASSKEY_QUESTION) if subset == "passkey" else (NUMBER_NEEDLE, NUMBER_QUESTION)

            def build(n: int) -> dict[str, Any]:
                before = round(depth * n)
                text = NOISE * before + needle + NOISE * (n - before)
                return {"context": text.replace("{key}", key), "input": question, "answer": key, "id": i,
                        "_noise": n, "_before": before}

            size = self._largest_fitting(subset, build, self.seq_len // 8, meter)  # a noise line is 18 words, ~25 tokens
            if size < 0:
                raise ValueError(f"{subset}: seq_len={self.seq_len} is too short for the needle; raise task.seq_len")
            row = build(size)
            meta = {"generated": True, "seq_len": self.seq_len, "noise_lines": row["_noise"],
                    "depth": row["_before"] / max(1, row["_noise"])}
        public = {k: v for k, v in row.items() if not k.startswith("_")}
        return self.build_sample(subset, public, i, seed, meta=meta)
