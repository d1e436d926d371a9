"""InfiniteBench scorers, rewritten from the benchmark's `src/compute_scores.py` (OpenBMB/InfiniteBench, commit 88b3daa).

Every scorer maps (prediction, answers, label=...) to a score in [0, 1]. `label` is the official label exactly as
`eval_utils.get_answer` builds it (a string, a list of strings, a list holding an int or float, or Math.Calc's
list of ints); the task module passes it through `Turn.metric_args`, since kvbench's `answers` are strings and
several rules compare numbers (Code.Run and Math.Find compare an int, Math.Calc a list of ints). Without `label`
the `answers` are taken as the label. The suite score is the mean x 100 over samples, as the benchmark averages.

| metric                          | task                | reference function                        |
| ------------------------------- | ------------------- | ----------------------------------------- |
| infinitebench_passkey           | Retrieve.PassKey    | `get_score_one_passkey`                   |
| infinitebench_number_string     | Retrieve.Number     | `get_score_one_number_string`             |
| infinitebench_kv_retrieval      | Retrieve.KV         | `get_score_one_kv_retrieval`              |
| infinitebench_longbook_sum_eng  | En.Sum              | `get_score_one_longbook_sum_eng`          |
| infinitebench_longbook_qa_eng   | En.QA               | `get_score_one_longbook_qa_eng`           |
| infinitebench_longbook_choice_eng | En.MC             | `get_score_one_longbook_choice_eng`       |
| infinitebench_longdialogue_qa_eng | En.Dia            | `get_score_one_longdialogue_qa_eng`       |
| infinitebench_longbook_qa_chn   | Zh.QA               | `get_score_one_longbook_qa_chn`           |
| infinitebench_code_debug        | Code.Debug          | `get_score_one_code_debug`                |
| infinitebench_code_run          | Code.Run            | `get_score_one_code_run`                  |
| infinitebench_math_find         | Math.Find           | `get_score_one_math_find`                 |
| infinitebench_math_calc         | Math.Calc           | `get_score_one_math_calc`                 |

Choices where the reference is ambiguous or breaks on some input:

- Retrieve.KV: the reference tests `label in words` with the label as given; the data's label is a string, but a
  row loaded through `datasets` may carry it as a one-element list, which the reference would never match. The
  first element is used then, as the reference's passkey rule does for lists.
- En.Sum: HF `evaluate`'s "rouge" with its defaults (rouge-score, no stemmer), ROUGE-Lsum F-measure; a list label
  is a multi-reference (`score_multi`, the best reference), as `evaluate` does when references are lists.
- Math.Calc: the reference drops the first predicted number for `model_name == "gpt4"` only; kvbench's models are
  never GPT-4, so nothing is dropped.
- OmniKV's copy of the scorer (antgroup/OmniKV `benchmark/infinite_bench/src/compute_scores.py`) adds "Answer:" and
  "Option:" to En.MC's answer prefixes; the benchmark's own rule is kept here.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

# the benchmark's normalisation and F1 are LongBench's, character for character (its compute_scores.py copies them)
from kvbench.tasks.longbench_metrics import normalize_answer, normalize_zh_answer, token_f1
from kvbench.tasks.scoring import register


def _label(answers: list[str], label: Any) -> Any:
    if label is None:
        if not answers:
            raise ValueError("an InfiniteBench scorer got neither a label nor answers; the sample is malformed")
        return list(answers)
    return label


def first_int_match(prediction: str) -> str:
    """The first run of ASCII digits in the prediction, "" when there is none (`first_int_match`)."""
    return next((item for item in re.split("[^0-9]", prediction) if item != ""), "")


def _first(label: Any) -> Any:
    return label[0] if isinstance(label, list) else label


def _replace_all(text: str, characters: list[str], by: str = " ") -> str:
    for c in characters:
        text = text.replace(c, by)
    return text


def _squeeze_double_spaces(text: str) -> str:
    while "  " in text:
        text = text.replace("  ", " ")
    return text


@register("infinitebench_passkey")
def passkey(prediction: str, answers: list[str], label: Any = None) -> float:
    """Retrieve.PassKey: the first digit run of the prediction equals the key."""
    return float(_first(_label(answers, label)) == first_int_match(prediction))


@register("infinitebench_number_string")
def number_string(prediction: str, answers: list[str], label: Any = None) -> float:
    """Retrieve.Number: the first digit run of the prediction equals the 10-digit sequence."""
    return float(_first(_label(answers, label)) == first_int_match(prediction))


@register("infinitebench_kv_retrieval")
def kv_retrieval(prediction: str, answers: list[str], label: Any = None) -> float:
    """Retrieve.KV: the value is one of the prediction's words after \\n : " ' . , ? ! { } become spaces."""
    words = _replace_all(prediction, ["\n", ":", '"', "'", ".", ",", "?", "!", "{", "}"]).split()
    return float(_first(_label(answers, label)) in words)


@register("infinitebench_code_run")
def code_run(prediction: str, answers: list[str], label: Any = None) -> float:
    """Code.Run: the last word of the prediction (after \\n . ` ' " : become spaces), read as an int, equals the
    return value."""
    gold = _first(_label(answers, label))
    if isinstance(gold, str):  # answers given as strings: the data stores the return value as an int
        gold = int(gold)
    words = _replace_all(prediction.strip(), ["\n", ".", "`", "'", '"', ":"]).split()
    if not words:
        return 0.0
    try:
        return float(gold == int(words[-1]))
    except ValueError:
        return 0.0


@register("infinitebench_code_debug")
def code_debug(prediction: str, answers: list[str], label: Any = None) -> float:
    """Code.Debug: label = [function name, option letter]. The prediction starts with "B." / "B:", or the text after
    the first of the answer prefixes found starts with the letter or the function name."""
    gold = _label(answers, label)
    function_name, letter = gold[0], gold[1]
    pred = prediction.strip()
    if pred[:2] in (f"{letter}.", f"{letter}:"):
        return 1.0
    pred = _squeeze_double_spaces(_replace_all(pred.strip(), ["\n", "`", "'", '"', "-", "*", "Option", "option"]))
    for prefix in ("answer is:", "is:", "answer:", "correct option is:"):
        idx = pred.find(prefix)
        if idx == -1:
            continue
        if len(pred) < idx + len(prefix) + 1:  # the prediction ends with the prefix
            return 0.0
        rest = pred[idx + len(prefix) + 1 :]
        return float(any(rest.startswith(s) for s in (letter, function_name)))
    return 0.0


@register("infinitebench_math_find")
def math_find(prediction: str, answers: list[str], label: Any = None) -> float:
    """Math.Find: the first number of the prediction (a decimal or an int) equals the label, compared as an int
    when the label is an int and as a float when it is a float."""
    gold = _first(_label(answers, label))
    if isinstance(gold, str):  # answers given as strings: read the label as the data stores it
        gold = float(gold) if "." in gold else int(gold)
    if isinstance(gold, bool) or not isinstance(gold, (int, float)):
        raise TypeError(f"Math.Find's label must be an int or a float, got {type(gold).__name__}")
    found = re.search(r"\d+\.\d+|\d+", prediction)
    if found is None:
        return 0.0
    number = found.group(0).strip()
    if isinstance(gold, int):
        try:
            return float(int(number) == gold)
        except ValueError:  # the reference's int("12.5") raises; a decimal never equals an int label
            return 0.0
    return float(float(number) == gold)


@register("infinitebench_math_calc")
def math_calc(prediction: str, answers: list[str], label: Any = None) -> float:
    """Math.Calc: the share of intermediate values the prediction's digit runs match in order, up to the first
    miss (signs are not read: the reference splits on every non-digit)."""
    gold = _label(answers, label)
    if not isinstance(gold, list):
        raise TypeError(f"Math.Calc's label must be a list, got {type(gold).__name__}")
    if gold and isinstance(gold[0], list):
        gold = gold[0]
    gold = [int(v) for v in gold]
    numbers = [int(item) for item in re.split("[^0-9]", prediction) if item != ""]
    matched = 0
    for expected, got in zip(gold, numbers):
        if expected != got:
            break
        matched += 1
    return matched / len(gold)


@register("infinitebench_longdialogue_qa_eng")
def longdialogue_qa_eng(prediction: str, answers: list[str], label: Any = None) -> float:
    """En.Dia: the first gold name is one of the upper-cased words of the prediction (after \\n : " ' . , ? ! { }
    become spaces). The reference compares the gold as stored: a lower-case gold never matches."""
    gold = _label(answers, label)[0]
    words = [w.upper() for w in _replace_all(prediction.strip(), ["\n", ":", '"', "'", ".", ",", "?", "!", "{", "}"]).split()]
    return float(gold in words)


@register("infinitebench_longbook_choice_eng")
def longbook_choice_eng(prediction: str, answers: list[str], label: Any = None) -> float:
    """En.MC: label = [option text, option letter]. The first character if it is A-D; else the whole prediction
    if it is one of the label's strings; else the text after the first answer prefix found; else the first word
    that is a substring of "ABCD"."""
    gold = _label(answers, label)
    pred = prediction.strip()
    if pred == "":
        return 0.0
    if pred[0] in "ABCD":
        return float(pred[0] in gold)
    if pred in gold:
        return 1.0
    pred = _squeeze_double_spaces(_replace_all(pred, ["\n", '"', "'", ".", ",", "?", "!", "{", "}"]))
    for prefix in ("answer is:", "answer:", "answer is", "option is"):
        idx = pred.find(prefix)
        if idx == -1:
            continue
        if len(pred) < idx + len(prefix) + 1:
            return 0.0
        rest = pred[idx + len(prefix) + 1 :]
        return float(any(rest.startswith(s) for s in gold))
    for word in pred.split():
        if word in "ABCD":  # a substring test, as in the reference ("AB" counts)
            return float(word in gold)
    return 0.0


@register("infinitebench_longbook_qa_eng")
def longbook_qa_eng(prediction: str, answers: list[str], label: Any = None) -> float:
    """En.QA: word-level F1 after `normalize_answer`, the best gold."""
    gold = _label(answers, label)
    pred_tokens = normalize_answer(prediction).split()
    return max((token_f1(pred_tokens, normalize_answer(g).split()) for g in gold), default=0.0)


@register("infinitebench_longbook_qa_chn")
def longbook_qa_chn(prediction: str, answers: list[str], label: Any = None) -> float:
    """Zh.QA: character-level F1 after `normalize_zh_answer`, the best gold (no word segmentation)."""
    gold = _label(answers, label)
    pred_chars = list(normalize_zh_answer(prediction))
    return max((token_f1(pred_chars, list(normalize_zh_answer(g))) for g in gold), default=0.0)


@lru_cache(maxsize=None)
def _rouge_lsum_scorer():
    """HF `evaluate`'s "rouge" defaults: rouge-score's tokenizer, no stemmer. Built on first use, so a machine that
    never scores En.Sum needs no rouge-score."""
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeLsum"], use_stemmer=False)


@register("infinitebench_longbook_sum_eng")
def longbook_sum_eng(prediction: str, answers: list[str], label: Any = None) -> float:
    """En.Sum: ROUGE-Lsum F-measure (summary-level LCS over newline-split sentences); a list label is scored as
    several references, the best one counting (`evaluate` passes lists to rouge-score's `score_multi`)."""
    gold = _label(answers, label)
    scorer = _rouge_lsum_scorer()
    if isinstance(gold, list):
        return scorer.score_multi(gold, prediction)["rougeLsum"].fmeasure
    return scorer.score(gold, prediction)["rougeLsum"].fmeasure
