"""Scorers of the synthetic tasks (RULER, NIAH passkey, 2StageRetr). Each maps (prediction, golds) to [0, 1].

- `string_match_all` / `string_match_part`: RULER (`scripts/eval/synthetic/constants.py`), after RULER's
  `postprocess_pred` (`scripts/eval/evaluate.py`). The task score is the mean x 100 over samples.
- `passkey_exact_match` / `passkey_partial_match`: the passkey test of Yuan et al. 2024 (longctx_bench
  `eval/passkey_utils/eval_metrics.py`), which RocketKV follows; the GPT-4 judge of Kamradt's NIAH is not
  available offline.
- `substring_ci` / `last_colour_match`: 2StageRetr (OmniKV `benchmark/long_bench/cot_pred.py`) and a strict
  variant that is robust to substring false positives ("red" in "required", "teal" in "steal").
"""

from __future__ import annotations

import re
import string
from difflib import SequenceMatcher

from kvbench.tasks.scoring import register

_CONTROL = re.compile(r"[\x00-\x1f]")
_PUNCTUATION = frozenset(string.punctuation)


def ruler_postprocess(prediction: str) -> str:
    """RULER's `postprocess_pred`: strip, replace each control character (\\x00-\\x1f) by a newline, strip.

    A paraphrase would say "remove control characters"; RULER's code replaces them by "\\n", which
    differs when a control character sits inside an answer ("12\\x0034" does not contain "1234").
    """
    return _CONTROL.sub("\n", prediction.strip()).strip()


def _check_refs(refs: list[str]) -> None:
    if not refs:
        raise ValueError("a scorer got no reference answers; the sample is malformed")


@register("string_match_all")
def string_match_all(prediction: str, refs: list[str]) -> float:
    """RULER: share of references contained (case-insensitively) in the post-processed prediction."""
    _check_refs(refs)
    pred = ruler_postprocess(prediction).lower()
    return sum(r.lower() in pred for r in refs) / len(refs)


@register("string_match_part")
def string_match_part(prediction: str, refs: list[str]) -> float:
    """RULER (QA): 1 if any reference is contained (case-insensitively) in the post-processed prediction."""
    _check_refs(refs)
    pred = ruler_postprocess(prediction).lower()
    return float(any(r.lower() in pred for r in refs))


def passkey_normalize(text: str) -> str:
    """longctx_bench `normalize_answer`: lower-case, drop ASCII punctuation, drop a/an/the, squeeze spaces.

    Articles are deleted without inserting a space, exactly as in the reference code.
    """
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", "", text)
    return " ".join(text.split())


@register("passkey_exact_match")
def passkey_exact_match(prediction: str, refs: list[str]) -> float:
    """longctx_bench exact match: 1 if a normalised gold key is a substring of the normalised response."""
    _check_refs(refs)
    pred = passkey_normalize(prediction)
    return float(any(passkey_normalize(r) in pred for r in refs))


@register("passkey_partial_match")
def passkey_partial_match(prediction: str, refs: list[str]) -> float:
    """longctx_bench partial match: longest common substring / gold length, on raw strings (max over golds)."""
    _check_refs(refs)

    def lcs_ratio(ref: str) -> float:
        match = SequenceMatcher(None, ref, prediction, autojunk=False).find_longest_match(0, len(ref), 0, len(prediction))
        return match.size / len(ref)

    return max(lcs_ratio(r) for r in refs if r) if any(refs) else 0.0


@register("substring_ci")
def substring_ci(prediction: str, refs: list[str]) -> float:
    """OmniKV's accuracy rule: 1 if any gold, lower-cased, is a substring of the lower-cased output.

    This is the paper-comparable 2StageRetr number; it counts "red" inside "considered" as correct.
    """
    _check_refs(refs)
    pred = prediction.lower()
    return float(any(r.lower() in pred for r in refs))


# The 23 colours of OmniKV's `tiny_runs/make_2_stage_questions.py`.
COLOURS = ("red", "green", "blue", "yellow", "orange", "purple", "pink", "brown", "black", "white", "gray", "cyan",
           "magenta", "indigo", "violet", "beige", "maroon", "navy", "olive", "teal", "lime", "silver", "gold")


@register("last_colour_match")
def last_colour_match(prediction: str, refs: list[str]) -> float:
    """Strict 2StageRetr variant (kvbench's): the last colour named as a whole word must be a gold colour.

    Candidates are the 23 OmniKV colours plus the golds; matching is case-insensitive on word boundaries.
    A chain of thought that lists several colours is judged by its final one, and "steal" does not count
    as "teal". No colour at all scores 0.
    """
    _check_refs(refs)
    golds = {r.lower() for r in refs}
    candidates = sorted(set(COLOURS) | golds, key=len, reverse=True)
    pattern = r"\b(" + "|".join(re.escape(c) for c in candidates) + r")\b"
    mentions = re.findall(pattern, prediction.lower())
    return float(bool(mentions) and mentions[-1] in golds)
