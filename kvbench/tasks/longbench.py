"""LongBench (v1) and LongBench-E: the official prompts, generation lengths, chat-template exclusions and metrics.

Protocol, following THUDM/LongBench `pred.py` / `eval.py` and the vendored `data/longbench/` configs:

- Prompt = `dataset2prompt[subset].format(**row)`, `max_new_tokens = dataset2maxlen[subset]`.
- trec, triviaqa, samsum, lsht, lcc and repobench-p are run without the chat template; the others with it.
- Prompts longer than the model limit are truncated in the middle (`Sample.truncation = "middle"`).
- samsum stops at a newline (`stop=["\\n"]`) and must generate at least one token (`meta["min_new_tokens"]`,
  the official `min_length=prompt+1`).
- Scores: see `kvbench.tasks.longbench_metrics` (first-line cut for trec/triviaqa/samsum/lsht, max over golds).

Three-part split (for question-agnostic compression): the NVIDIA KVPress split that Ada-KV used. The context
part runs from the start of the template through `{context}` *and* any instruction that repeats after it
("Now, answer the question based on ..."), i.e. up to the question marker (`Question: {input}`, `Query:`,
`问题：`, the few-shot test item, the abstract, the in-file code prefix). The question part is the rest, and the
answer cue ("Answer:", "Summary:", "The answer is: ", "Next line of code:\\n", ...) ends it. For every row,
context + question + answer_prefix == the official prompt string.

Where the answer cue goes (`prefix_placement`):
- "user" (default, official LongBench): the cue stays at the end of the question part, so the chat template
  wraps the whole official prompt, cue included, as one user message; `Turn.answer_prefix` is "".
- "assistant" (KVPress / Ada-KV): the cue is `Turn.answer_prefix`, which the engine writes after the
  assistant header. Raw-prompt subsets get the same string either way.

The few-shot subsets have no separate cue: their test item (`{input}`) already ends with "Type:", "Answer:",
"Summary:" or "类别：".

Data: `<subset>.jsonl` / `<subset>_e.jsonl` from the `data.zip` of the HF dataset THUDM/LongBench, in
`data_dir` or `data_dir/data`; without `data_dir`, the HF datasets cache is used if it holds THUDM/LongBench.

OmniKV's multi-step protocol (`protocol`, OmniKV §5.1 / Fig. 3 / App. D.4 Table 6; antgroup/OmniKV
`benchmark/long_bench/cot_pred.py` and `configs/template_for_chat.py`), for 2wikimqa and hotpotqa only:

- `omnikv_cot`: the user message is cot_pred.py's `data_format` (LongBench's multi-doc QA prompt with the
  instruction repeated after the passages and without "Only give me the answer and do not output any other
  words"), the assistant turn is pre-filled with the authors' chain-of-thought lead-in, greedy, 200 new tokens,
  and a sample is correct when any gold answer, lower-cased, is a substring of the lower-cased output (the
  paper's "Exact Match"; metric `substring_ci`, the one 2StageRetr uses). `omnikv_direct`: the same prompt and
  scoring without the lead-in (Table 6's "CoT ✗" row). `official` (default): LongBench's own protocol above.
- `omnikv_template` picks which of the authors' templates wraps the message, as cot_pred.py picks it by model
  name: `llama` (default) puts the message in the model's chat template and the lead-in "Evidence (step by step)
  then answer: 1." after the assistant header (the authors' hand-written Llama-3 string also carries the system
  prompt "You are a helpful assistant. ": a preset sets it with `engine.system_prompt`); `yi` is the raw string
  they used for the base model Yi-9B-200K (no chat template): "You are helpful assistant who thinks step by
  step.\\nYou will give your final answer in less than 80 words.\\n{message}\\nEvidence (less than 5 steps) then
  final answer: Step 1:" (direct: "You are helpful assistant.\\n{message}").
- Split: the context part ends after the passages, the question part is the repeated instruction and the
  question, the lead-in is the answer prefix, so question-agnostic compression sees the passages alone.
- kvbench choices: prompts over the model's limit are middle-truncated in tokens, as for the official protocol
  (cot_pred.py truncates the decoded halves of the token ids at the config's `max_context_len`); `num_samples`
  keeps the first rows (cot_pred.py's `test_num` keeps the last; the paper's numbers are over all 200 rows).
  `prefix_placement` concerns the official prompt only: the lead-in always follows the assistant header.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvbench.tasks.base import DatasetMissingError, PromptMeter, Sample, Task, Turn, read_jsonl, subset_files
from kvbench.tasks.longbench_metrics import (
    ALL_SUBSETS,
    ENGLISH_SUBSETS,
    FIRST_LINE_SUBSETS,
    OMNIKV_MULTISTEP_METRIC,
)

_CONFIG_DIR = Path(__file__).parent / "data" / "longbench"
PROMPTS: dict[str, str] = json.loads((_CONFIG_DIR / "dataset2prompt.json").read_text(encoding="utf-8"))
MAX_NEW_TOKENS: dict[str, int] = json.loads((_CONFIG_DIR / "dataset2maxlen.json").read_text(encoding="utf-8"))

# Subsets that LongBench-E (length-balanced) provides.
E_SUBSETS = (
    "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "gov_report", "multi_news",
    "trec", "triviaqa", "samsum", "passage_count", "passage_retrieval_en", "lcc", "repobench-p",
)  # fmt: skip
# Official pred.py: "chat models are better off without build prompts on these tasks".
NO_CHAT_TEMPLATE = ("trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p")

# Per subset: (the text where the question part starts, the answer cue that ends the template). These are the
# KVPress split points (evaluation/benchmarks/longbench/create_huggingface_dataset.py), written as anchors
# into the vendored template rather than as retyped template pieces.
_SPLIT: dict[str, tuple[str, str]] = {
    "narrativeqa": ("\n\nQuestion: {input}", "Answer:"),
    "qasper": ("\n\nQuestion: {input}", "Answer:"),
    "multifieldqa_en": ("\n\nQuestion: {input}", "Answer:"),
    "multifieldqa_zh": ("\n\n问题：{input}", "回答："),
    "hotpotqa": ("\n\nQuestion: {input}", "Answer:"),
    "2wikimqa": ("\n\nQuestion: {input}", "Answer:"),
    "musique": ("\n\nQuestion: {input}", "Answer:"),
    "dureader": ("\n\n问题：{input}", "回答："),
    "gov_report": ("\n\nSummary:", "Summary:"),
    "qmsum": ("\n\nQuery: {input}", "Answer:"),
    "multi_news": ("\n\nSummary:", "Summary:"),
    "vcsum": ("\n\n会议总结：", "会议总结："),
    "trec": ("\n{input}", ""),
    "triviaqa": ("\n\n{input}", ""),
    "samsum": ("\n\n{input}", ""),
    "lsht": ("\n{input}", ""),
    "passage_count": ("\n\nThe final answer is: ", "The final answer is: "),
    "passage_retrieval_en": ("\n\n{input}", "The answer is: "),
    "passage_retrieval_zh": ("\n\n{input}", "答案是："),
    "lcc": ("Next line of code:\n", "Next line of code:\n"),
    "repobench-p": ("{input}", "Next line of code:\n"),
}

_BASE_METRIC = {
    "narrativeqa": "qa_f1", "qasper": "qa_f1", "multifieldqa_en": "qa_f1", "multifieldqa_zh": "qa_f1_zh",
    "hotpotqa": "qa_f1", "2wikimqa": "qa_f1", "musique": "qa_f1", "dureader": "rouge_zh",
    "gov_report": "rouge", "qmsum": "rouge", "multi_news": "rouge", "vcsum": "rouge_zh",
    "trec": "classification", "triviaqa": "qa_f1", "samsum": "rouge", "lsht": "classification",
    "passage_count": "count", "passage_retrieval_en": "retrieval", "passage_retrieval_zh": "retrieval_zh",
    "lcc": "code_sim", "repobench-p": "code_sim",
}  # fmt: skip

_ROW_KEYS = ("input", "context", "answers", "length", "language", "all_classes", "_id")
_HF_REPO = "THUDM/LongBench"

PROTOCOLS = ("official", "omnikv_cot", "omnikv_direct")
OMNIKV_SUBSETS = ("2wikimqa", "hotpotqa")  # the LongBench datasets of OmniKV's multi-step runs
OMNIKV_TEMPLATES = ("llama", "yi")
# cot_pred.py's `data_format`, split after the passages (context | question); the two parts concatenate to it.
OMNIKV_CONTEXT = ("Answer the question based on the given passages. \n\nThe following are given passages.\n"
                  "{context}")
OMNIKV_QUESTION = "\n\nAnswer the question based on the given passages. \n\nQuestion: {input}\n"
OMNIKV_MAX_NEW_TOKENS = 200  # cot_pred.py's GenerationConfig(do_sample=False, max_new_tokens=200)
# configs/template_for_chat.py: what the authors' templates put around the message, per template and protocol:
# (text before the message, answer prefix after it). The Llama templates' chat markup is the engine's.
OMNIKV_WRAPPERS: dict[tuple[str, str], tuple[str, str]] = {
    ("llama", "omnikv_cot"): ("", "Evidence (step by step) then answer: 1."),  # llama_cot
    ("llama", "omnikv_direct"): ("", ""),  # llama
    ("yi", "omnikv_cot"): ("You are helpful assistant who thinks step by step.\n"
                           "You will give your final answer in less than 80 words.\n",
                           "\nEvidence (less than 5 steps) then final answer: Step 1:"),  # yi_cot
    ("yi", "omnikv_direct"): ("You are helpful assistant.\n", ""),  # yi
}


def split_template(subset: str) -> tuple[str, str, str]:
    """(context template, question template, answer cue) whose concatenation is the official template."""
    template = PROMPTS[subset]
    anchor, cue = _SPLIT[subset]
    start = template.index(anchor)
    # The split must fall after {context}, be unambiguous and end on the cue, or the parts would not
    # reassemble into the official prompt.
    if template.count(anchor) != 1 or start < template.index("{context}") + len("{context}"):
        raise ValueError(f"{subset}: split anchor {anchor!r} is not unique after {{context}}")
    if not template.endswith(cue):
        raise ValueError(f"{subset}: template does not end with the answer cue {cue!r}")
    return template[:start], template[start : len(template) - len(cue)], cue


# Built (and checked) once at import: a vendored-template edit that breaks the split fails loudly here.
TEMPLATE_PARTS: dict[str, tuple[str, str, str]] = {s: split_template(s) for s in ALL_SUBSETS}


def metric_for(subset: str, all_classes: Sequence[str] | None) -> tuple[str, dict]:
    """The registered metric name a subset's samples are scored with, and its extra scorer arguments."""
    base = _BASE_METRIC[subset]
    if base == "classification":
        if not all_classes:
            raise ValueError(f"{subset}: classification needs the row's all_classes")
        return "longbench_classification_first_line", {"all_classes": list(all_classes)}
    return f"longbench_{base}" + ("_first_line" if subset in FIRST_LINE_SUBSETS else ""), {}


def _missing_message(names: Sequence[str], where: str) -> str:
    return (
        f"LongBench data ({_HF_REPO}) not found for {', '.join(names)}: {where}.\n"
        "Get the official data.zip on a machine with internet access and unpack it:\n"
        f"  huggingface-cli download {_HF_REPO} data.zip --repo-type dataset --local-dir longbench\n"
        f"  # or: wget https://huggingface.co/datasets/{_HF_REPO}/resolve/main/data.zip -P longbench\n"
        "  cd longbench && unzip data.zip   # creates data/<subset>.jsonl and data/<subset>_e.jsonl\n"
        "then run with task.data_dir=/abs/path/to/longbench/data"
    )


def _hf_cache_has_longbench() -> bool:
    import datasets  # slow to import; only needed without data_dir

    return any(Path(datasets.config.HF_DATASETS_CACHE).glob("THUDM___long_bench*"))


def _load_hf(config: str) -> list[dict[str, Any]]:
    import datasets

    try:
        return [dict(row) for row in datasets.load_dataset(_HF_REPO, config, split="test")]
    except Exception as err:  # noqa: BLE001 - any failure here means "not available offline"
        raise DatasetMissingError(
            _missing_message([config], f"loading it from the HF datasets cache failed ({err})")
        ) from err


class LongBench(Task):
    """LongBench v1 subsets (default: the 16 English ones) or LongBench-E (`e=True`, 13 subsets).

    `num_samples` keeps the first N rows of each subset in file order (all when None); the order is the
    dataset's, so every seed and method sees the same rows. LongBench is fixed data: `samples` ignores the
    seed and the meter (lengths are the data's, and truncation is the engine's job). `seq_len` is only
    recorded. `protocol` / `omnikv_template`: OmniKV's multi-step protocol (module docstring).
    `max_new_tokens` (null: the protocol's own) caps generation for quick runs; such points are not the paper's.
    """

    name = "longbench"

    def __init__(
        self,
        name: str = "longbench",
        subsets: Sequence[str] | None = None,
        num_samples: int | None = None,
        seq_len: int | None = None,
        data_dir: str | None = None,
        e: bool = False,
        prefix_placement: str = "user",
        protocol: str = "official",
        omnikv_template: str = "llama",
        max_new_tokens: int | None = None,
    ) -> None:
        self.name = name
        self.e = bool(e)
        allowed = E_SUBSETS if self.e else ALL_SUBSETS
        self.subsets = list(subsets) if subsets is not None else list(E_SUBSETS if self.e else ENGLISH_SUBSETS)
        bad = [s for s in self.subsets if s not in allowed]
        if not self.subsets:
            raise ValueError(f"subsets is empty; give at least one of {list(allowed)} (or null: "
                             f"{'LongBench-E' if self.e else 'the English subsets'})")
        if bad:
            kind = "LongBench-E" if self.e else "LongBench"
            raise ValueError(f"{bad} not in {kind}; choose from {list(allowed)}")
        if num_samples is not None and num_samples < 1:
            raise ValueError("num_samples must be >= 1 or null")
        if prefix_placement not in ("user", "assistant"):
            raise ValueError("prefix_placement must be 'user' (official LongBench) or 'assistant' (KVPress)")
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {list(PROTOCOLS)}, not {protocol!r}")
        if omnikv_template not in OMNIKV_TEMPLATES:
            raise ValueError(f"omnikv_template must be one of {list(OMNIKV_TEMPLATES)}, not {omnikv_template!r}")
        if protocol != "official" and any(s not in OMNIKV_SUBSETS for s in self.subsets):
            raise ValueError(f"protocol {protocol} is OmniKV's multi-step protocol for {list(OMNIKV_SUBSETS)}; "
                             f"task.subsets has {[s for s in self.subsets if s not in OMNIKV_SUBSETS]}")
        if max_new_tokens is not None and (isinstance(max_new_tokens, bool) or int(max_new_tokens) != max_new_tokens
                                           or max_new_tokens < 1):
            raise ValueError(f"max_new_tokens must be a positive number of tokens or null, got {max_new_tokens!r}")
        self.protocol = protocol
        self.omnikv_template = omnikv_template
        # null: the protocol's own (dataset2maxlen, or OmniKV's 200); a number caps quick runs and tests
        self.max_new_tokens = None if max_new_tokens is None else int(max_new_tokens)
        self.num_samples = num_samples
        self.seq_len = seq_len
        self.data_dir = Path(data_dir).expanduser() if data_dir is not None else None
        self.prefix_placement = prefix_placement

    def _config_name(self, subset: str) -> str:
        return f"{subset}_e" if self.e else subset

    def check(self) -> None:
        """A `data_dir` without the subsets' files, before the model loads (the HF cache is looked in later)."""
        if self.data_dir is not None:
            subset_files(self.data_dir, {s: self._config_name(s) for s in self.subsets}, _missing_message)

    def load_rows(self) -> dict[str, list[dict[str, Any]]]:
        """Raw rows per subset, from `data_dir` (or `data_dir/data`) or else the HF datasets cache."""
        names = {s: self._config_name(s) for s in self.subsets}
        if self.data_dir is not None:
            paths = subset_files(self.data_dir, names, _missing_message)
            return {s: read_jsonl(p, _ROW_KEYS, "LongBench") for s, p in paths.items()}
        if not _hf_cache_has_longbench():
            raise DatasetMissingError(
                _missing_message(list(names.values()), "task.data_dir is not set and the HF datasets cache lacks it")
            )
        return {s: _load_hf(config) for s, config in names.items()}

    def samples(self, meter: PromptMeter, seed: int) -> list[Sample]:
        out = []
        for subset, rows in self.load_rows().items():
            if self.num_samples is not None:
                rows = rows[: self.num_samples]
            out.extend(self.build_sample(subset, row) for row in rows)
        return out

    def build_sample(self, subset: str, row: dict[str, Any]) -> Sample:
        """One sample from one LongBench row (the jsonl/HF row format)."""
        if self.protocol != "official":
            return self.build_omnikv_sample(subset, row)
        context_t, question_t, cue = TEMPLATE_PARTS[subset]
        # `.format(**row)` as in pred.py; each piece holds only its own placeholders.
        context = context_t.format(**row)
        question = question_t.format(**row)
        if self.prefix_placement == "user":
            question, cue = question + cue, ""
        task = f"longbench_e_{subset}" if self.e else f"longbench_{subset}"
        meta = self._meta(subset, row)
        if subset == "samsum":
            meta["min_new_tokens"] = 1
        metric, metric_args = metric_for(subset, row["all_classes"])
        return Sample(
            id=f"{task}/{row['_id']}",
            task=task,
            context=context,
            turns=[
                Turn(
                    question=question,
                    answers=list(row["answers"]),
                    max_new_tokens=self.max_new_tokens or MAX_NEW_TOKENS[subset],
                    metric=metric,
                    answer_prefix=cue,
                    metric_args=metric_args,
                )
            ],
            chat_template=subset not in NO_CHAT_TEMPLATE,
            stop=["\n"] if subset == "samsum" else [],
            truncation="middle",
            meta=meta,
        )

    def _meta(self, subset: str, row: dict[str, Any]) -> dict[str, Any]:
        return {
            "subset": subset,
            "longbench_e": self.e,
            "length": row["length"],
            "language": row["language"],
            "all_classes": row["all_classes"],
            "source_id": row["_id"],
        }

    def build_omnikv_sample(self, subset: str, row: dict[str, Any]) -> Sample:
        """One sample of OmniKV's multi-step protocol (module docstring) from one 2wikimqa/hotpotqa row."""
        before, lead_in = OMNIKV_WRAPPERS[(self.omnikv_template, self.protocol)]
        task = f"longbench_e_{subset}" if self.e else f"longbench_{subset}"
        meta = {**self._meta(subset, row), "protocol": self.protocol, "omnikv_template": self.omnikv_template}
        return Sample(
            id=f"{task}/{row['_id']}",
            task=task,
            context=before + OMNIKV_CONTEXT.format(**row),
            turns=[
                Turn(
                    question=OMNIKV_QUESTION.format(**row),
                    answers=list(row["answers"]),
                    max_new_tokens=self.max_new_tokens or OMNIKV_MAX_NEW_TOKENS,
                    metric=OMNIKV_MULTISTEP_METRIC,
                    answer_prefix=lead_in,
                )
            ],
            chat_template=self.omnikv_template == "llama",
            truncation="middle",
            meta=meta,
        )
