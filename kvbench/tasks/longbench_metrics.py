"""LongBench (v1) scorers and aggregation rules, reimplemented from THUDM/LongBench `metrics.py` / `eval.py`.

Protocol (official `eval.py`): for each sample, `score = max(0, max over gold answers g of metric(pred', g))`,
where `pred'` is the first line of `pred.lstrip("\\n")` for trec, triviaqa, samsum and lsht and `pred`
otherwise; a subset's score is `round(100 * mean, 2)`.

Registered metric names (all prefixed `longbench_`, because the registry is global and other families use
the same words for different computations, e.g. SCBench's ROUGE comes from `rouge-score`, not `rouge`):

- `longbench_qa_f1`, `longbench_qa_f1_zh`, `longbench_rouge`, `longbench_rouge_zh`, `longbench_retrieval`,
  `longbench_retrieval_zh`, `longbench_count`, `longbench_code_sim`;
- `longbench_qa_f1_first_line` (triviaqa) and `longbench_rouge_first_line` (samsum): the same with the
  first-line cut;
- `longbench_classification_first_line` (trec, lsht): the classification scorer also needs the row's class
  list, which the sample carries in `Turn.metric_args = {"all_classes": [...]}` (so saved or exported samples
  score anywhere, with no registration step).

OmniKV's multi-step protocol (`LongBench(protocol="omnikv_cot" | "omnikv_direct")`, OmniKV §5.1) scores 2wikimqa
and hotpotqa with `OMNIKV_MULTISTEP_METRIC`: the registered `substring_ci` of `kvbench.tasks.metrics`, which is
cot_pred.py's rule (`any(ans.lower() in llm_out.lower() for ans in answers)`, the paper's "Exact Match: as long
as the standard answer appears in the model's output"). There is no answer extraction: the authors match the
whole generated text, chain of thought included, so neither does kvbench; the name is the very scorer 2StageRetr
uses, not a copy of it.

Libraries are the ones LongBench uses, pinned because they change numbers: `rouge==1.0.1` (pltrdy; not
`rouge-score`), `jieba==0.42.1`, `fuzzywuzzy==0.18.0` with `python-Levenshtein==0.27.5` as its matcher
(without it fuzzywuzzy falls back to difflib, which gives different ratios).
"""

from __future__ import annotations

import logging
import math
import re
import string
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from functools import cache

from kvbench.tasks.scoring import register


# The scorers' libraries are imported on first use: a machine that never scores LongBench (a GPU node running
# only the latency scripts, whose image lacks them) imports this module with the engine all the same.
@cache
def _jieba():
    import jieba

    jieba.setLogLevel(logging.WARNING)  # it announces its dictionary loading on the root handler at INFO level
    return jieba


@cache
def _fuzz():
    from fuzzywuzzy import fuzz

    return fuzz


@cache
def _rouge():
    from rouge import Rouge

    return Rouge

PairMetric = Callable[[str, str], float]

# The category of every subset as in the LongBench paper (Chinese subsets included).
CATEGORIES: dict[str, tuple[str, ...]] = {
    "single_doc_qa": ("narrativeqa", "qasper", "multifieldqa_en", "multifieldqa_zh"),
    "multi_doc_qa": ("hotpotqa", "2wikimqa", "musique", "dureader"),
    "summarization": ("gov_report", "qmsum", "multi_news", "vcsum"),
    "few_shot": ("trec", "triviaqa", "samsum", "lsht"),
    "synthetic": ("passage_count", "passage_retrieval_en", "passage_retrieval_zh"),
    "code": ("lcc", "repobench-p"),
}
CHINESE_SUBSETS = ("multifieldqa_zh", "dureader", "vcsum", "lsht", "passage_retrieval_zh")
ALL_SUBSETS = tuple(s for members in CATEGORIES.values() for s in members)
ENGLISH_SUBSETS = tuple(s for s in ALL_SUBSETS if s not in CHINESE_SUBSETS)  # the "16 English" set
FIRST_LINE_SUBSETS = ("trec", "triviaqa", "samsum", "lsht")
# OmniKV's multi-step scoring (module docstring): registered in kvbench.tasks.metrics, named here by its name.
OMNIKV_MULTISTEP_METRIC = "substring_ci"

_CN_PUNCTUATION = (
    "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."
)
_EN_PUNCTUATION = frozenset(string.punctuation)
_ZH_PUNCTUATION = frozenset(string.punctuation + _CN_PUNCTUATION)


# ---------------------------------------------------------------------------------------------------------
# Pairwise metrics: one prediction against one gold answer, exactly as in LongBench `metrics.py`.
# ---------------------------------------------------------------------------------------------------------


def normalize_answer(text: str) -> str:
    """Lower-case, drop ASCII punctuation, drop the articles a/an/the, squeeze whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _EN_PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def normalize_zh_answer(text: str) -> str:
    """Lower-case, drop ASCII and CJK punctuation, delete all whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _ZH_PUNCTUATION)
    return "".join(text.split())


def token_f1(prediction_tokens: Sequence[str], gold_tokens: Sequence[str]) -> float:
    """Multiset token F1 = 2PR/(P+R); 0 when nothing overlaps."""
    num_same = sum((Counter(prediction_tokens) & Counter(gold_tokens)).values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(prediction_tokens)
    recall = num_same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def qa_f1_score(prediction: str, gold: str) -> float:
    return token_f1(normalize_answer(prediction).split(), normalize_answer(gold).split())


def _jieba_tokens(text: str) -> list[str]:
    return list(_jieba().cut(text, cut_all=False))


def qa_f1_zh_score(prediction: str, gold: str) -> float:
    """Token F1 over jieba (accurate mode) words, each normalised; words that normalise to "" are dropped."""
    pred_tokens = [t for t in map(normalize_zh_answer, _jieba_tokens(prediction)) if t]
    gold_tokens = [t for t in map(normalize_zh_answer, _jieba_tokens(gold)) if t]
    return token_f1(pred_tokens, gold_tokens)


def rouge_score(prediction: str, gold: str) -> float:
    """ROUGE-L F of the `rouge` package (summary-level LCS over "."-split sentences of whitespace words).

    Like LongBench, any exception from the library scores 0: an empty (or punctuation-only) prediction, and
    also the RecursionError its recursive LCS reconstruction raises on very long sentences. LongBench uses a
    bare `except:`; catching `Exception` differs only for KeyboardInterrupt/SystemExit, which must propagate.
    """
    try:
        scores = _rouge()().get_scores([prediction], [gold], avg=True)
    except Exception:  # noqa: BLE001 - the protocol scores every library failure as 0
        return 0.0
    return float(scores["rouge-l"]["f"])


def rouge_zh_score(prediction: str, gold: str) -> float:
    """`rouge_score` on jieba-segmented text joined with spaces."""
    return rouge_score(" ".join(_jieba_tokens(prediction)), " ".join(_jieba_tokens(gold)))


def _number_fraction(prediction: str, target: str) -> float:
    """Fraction of the digit runs in the prediction that equal `target`; 0 when there are none."""
    numbers = re.findall(r"\d+", prediction)
    if not numbers:
        return 0.0
    return sum(1 for n in numbers if n == target) / len(numbers)


def _gold_paragraph_id(gold: str, pattern: str) -> str:
    match = re.search(pattern, gold)
    if match is None:
        raise ValueError(f"gold answer {gold!r} does not match {pattern!r}")
    return match.group(1)


def retrieval_score(prediction: str, gold: str) -> float:
    """passage_retrieval_en: gold is "Paragraph N"; score = share of the prediction's numbers equal to N."""
    return _number_fraction(prediction, _gold_paragraph_id(gold, r"Paragraph (\d+)"))


def retrieval_zh_score(prediction: str, gold: str) -> float:
    """passage_retrieval_zh: as `retrieval_score` with the gold pattern "段落N"."""
    return _number_fraction(prediction, _gold_paragraph_id(gold, r"段落(\d+)"))


def count_score(prediction: str, gold: str) -> float:
    """passage_count: share of the prediction's numbers equal to the gold count (compared as strings)."""
    return _number_fraction(prediction, str(gold))


def code_sim_score(prediction: str, gold: str) -> float:
    """Edit similarity of the first code line: `fuzz.ratio(line, gold) / 100`.

    `line` is the first line of `prediction.lstrip("\\n")` containing none of "`", "#", "//" (empty when every
    line has one). fuzz.ratio is an integer: `int(round(100 * ratio))` with Python's half-to-even rounding.
    """
    line = next(
        (ln for ln in prediction.lstrip("\n").split("\n") if "`" not in ln and "#" not in ln and "//" not in ln),
        "",
    )
    return _fuzz().ratio(line, gold) / 100


def classification_score(prediction: str, gold: str, all_classes: Sequence[str]) -> float:
    """trec/lsht: 1/|matches| if the gold class is among the class names found in the prediction, else 0.

    Reproduces two quirks of LongBench's code that change scores:
    - matches that are substrings of the gold (but not the gold itself) are removed *while iterating over the
      same list*, so the element after each removed one is never examined and may stay;
    - the difflib fallback for "no class matched" is unreachable there (it tests `list != 0`), so no match
      scores 0 here too.
    """
    matches = [name for name in all_classes if name in prediction]
    # Mutating the list under iteration is the protocol (see docstring); do not "fix" it.
    for name in matches:
        if name in gold and name != gold:
            matches.remove(name)
    return 1.0 / len(matches) if gold in matches else 0.0


# ---------------------------------------------------------------------------------------------------------
# Registered scorers: max over gold answers, optionally after the first-line cut.
# ---------------------------------------------------------------------------------------------------------


def first_line(prediction: str) -> str:
    """The few-shot cut: first line after stripping leading newlines (only "\\n", not other whitespace)."""
    return prediction.lstrip("\n").split("\n")[0]


def best_over_answers(metric: PairMetric, prediction: str, answers: Sequence[str]) -> float:
    """max(0, metric against each gold answer); 0 when there is no gold answer."""
    return max([0.0, *(metric(prediction, gold) for gold in answers)])


def _scorer(metric: PairMetric, cut_first_line: bool) -> Callable[[str, list[str]], float]:
    def score(prediction: str, answers: list[str]) -> float:
        if cut_first_line:
            prediction = first_line(prediction)
        return best_over_answers(metric, prediction, answers)

    score.__doc__ = f"LongBench {metric.__name__}{' on the first line' if cut_first_line else ''}, max over answers."
    return score


_PAIR_METRICS: dict[str, PairMetric] = {
    "qa_f1": qa_f1_score,
    "qa_f1_zh": qa_f1_zh_score,
    "rouge": rouge_score,
    "rouge_zh": rouge_zh_score,
    "retrieval": retrieval_score,
    "retrieval_zh": retrieval_zh_score,
    "count": count_score,
    "code_sim": code_sim_score,
}
for _name, _metric in _PAIR_METRICS.items():
    register(f"longbench_{_name}")(_scorer(_metric, cut_first_line=False))
for _name in ("qa_f1", "rouge"):  # the first-line subsets that do not use classification: triviaqa, samsum
    register(f"longbench_{_name}_first_line")(_scorer(_PAIR_METRICS[_name], cut_first_line=True))


@register("longbench_classification_first_line")
def classification_first_line(prediction: str, answers: list[str], all_classes: Sequence[str]) -> float:
    """trec/lsht: classification on the first line against the row's class list (`Turn.metric_args`)."""
    classes = list(all_classes)
    return best_over_answers(lambda p, g: classification_score(p, g, classes), first_line(prediction), answers)


# ---------------------------------------------------------------------------------------------------------
# Aggregation.
# ---------------------------------------------------------------------------------------------------------


def longbench_subset_score(sample_scores: Sequence[float]) -> float:
    """A subset's score as LongBench reports it: round(100 * mean of per-sample scores in [0, 1], 2)."""
    if not sample_scores:
        raise ValueError("no sample scores")
    return round(100 * sum(sample_scores) / len(sample_scores), 2)


def longbench_e_buckets(sample_scores: Sequence[float], lengths: Sequence[int]) -> dict[str, float]:
    """LongBench-E: subset score per `length` bucket, <4000, 4000-7999 and >=8000 (words; characters for ZH).

    An empty bucket is NaN, as `np.mean([])` gives in the official `eval.py`.
    """
    if len(sample_scores) != len(lengths):
        raise ValueError("one length per score is needed")
    buckets: dict[str, list[float]] = {"0-4k": [], "4-8k": [], "8k+": []}
    for value, length in zip(sample_scores, lengths):
        key = "0-4k" if length < 4000 else "4-8k" if length < 8000 else "8k+"
        buckets[key].append(value)
    return {key: longbench_subset_score(vals) if vals else math.nan for key, vals in buckets.items()}


def _mean(values: Sequence[float]) -> float:
    return round(sum(values) / len(values), 2)


def longbench_averages(per_subset_scores: Mapping[str, float]) -> dict[str, float]:
    """Every headline average the five papers (docs/papers.md) use, from per-subset scores (each already x100).

    Keys (a key is present only when all the subsets its rule needs are given):
    - `en16_mean`: mean of the 16 English subsets (KeyDiff, Ada-KV "Avg").
    - `rocketkv_lb_avg`: mean of those 16 without passage_count (RocketKV "LB Avg").
    - `subset_mean`: mean of all given subsets (CTKVR Tab. 12 when given its 13).
    - `category/<name>`: mean of the given subsets of that category; Chinese subsets count in their category
      (OmniKV folds dureader, vcsum, lsht in). Pass only the subsets the comparison uses.
    - `category_mean`: mean of the category means present (OmniKV Tab. 1 "Avg", CTKVR Tab. 2 "AVG").
    Values are rounded to 2 decimals; category means are averaged unrounded.
    """
    unknown = set(per_subset_scores) - set(ALL_SUBSETS)
    if unknown:
        raise ValueError(f"not LongBench subsets: {sorted(unknown)}")
    if not per_subset_scores:
        raise ValueError("no subset scores")
    out: dict[str, float] = {}
    if all(s in per_subset_scores for s in ENGLISH_SUBSETS):
        out["en16_mean"] = _mean([per_subset_scores[s] for s in ENGLISH_SUBSETS])
        out["rocketkv_lb_avg"] = _mean([per_subset_scores[s] for s in ENGLISH_SUBSETS if s != "passage_count"])
    out["subset_mean"] = _mean(list(per_subset_scores.values()))
    category_means: list[float] = []
    for category, members in CATEGORIES.items():
        present = [per_subset_scores[s] for s in members if s in per_subset_scores]
        if present:
            mean = sum(present) / len(present)
            category_means.append(mean)
            out[f"category/{category}"] = round(mean, 2)
    out["category_mean"] = _mean(category_means)
    return out
