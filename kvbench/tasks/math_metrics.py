"""Math-500 answer checking: last-`\\boxed{}` extraction, then an exact rule and an equivalence rule.

Protocol (KeyDiff App. E "Exact Match" / "Flex Match"):

1. Extraction (Hendrycks MATH `last_boxed_only_string` + `remove_boxed`): the content of the last `\\boxed{...}`
   in the response, braces matched; only when the response has no `\\boxed` at all, the last `\\fbox{...}`. A
   `\\boxed` not followed by `{` (e.g. `\\boxed 5`), or with unbalanced braces, extracts nothing. No extraction
   scores 0 under both rules.
2. `math_exact`: Hendrycks' `is_equiv`, i.e. equality after the MATH normaliser `strip_string` (drop line breaks,
   `\\!`, `\\left`/`\\right`, degrees, `\\$`, a trailing `\\text{ unit}`, `%`; `dfrac`/`tfrac` → `frac`;
   `\\frac12` → `\\frac{1}{2}`, `\\sqrt2` → `\\sqrt{2}`; `.5` → `0.5`, `0.5` → `\\frac{1}{2}`; `a/b` →
   `\\frac{a}{b}`; a short `x =` prefix dropped; spaces removed). If the normaliser raises, raw strings are
   compared (as in Hendrycks).
3. `math_equiv`: `math_exact`, or else HF math-verify (pinned 0.9.0) finds the two equivalent. Both sides are
   parsed from `\\boxed{<answer>}` with math-verify's LaTeX extraction and compared with `verify(gold, pred)`
   (numeric tolerance, symbolic simplification, sets/intervals/matrices). Taking the union with the exact rule
   keeps flex ≥ exact per sample, as in KeyDiff's tables; math-verify alone misses some forms the MATH
   normaliser accepts (e.g. `5\\%` vs `5`).
"""

from __future__ import annotations

import threading

from kvbench.tasks.scoring import register

# ---------------------------------------------------------------------------------------------------------------
# Extraction
# ---------------------------------------------------------------------------------------------------------------


def last_boxed(text: str) -> str | None:
    """Content of the last brace-matched `\\boxed{...}` (else last `\\fbox{...}`), or None."""
    command = "\\boxed"
    idx = text.rfind(command)
    if idx < 0:
        command = "\\fbox"
        idx = text.rfind(command)
        if idx < 0:
            return None
    start = idx + len(command)
    if text[start : start + 1] != "{":
        return None
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i]
    return None


# ---------------------------------------------------------------------------------------------------------------
# Hendrycks MATH normaliser (modeling/math_equivalence.py), reimplemented
# ---------------------------------------------------------------------------------------------------------------


def _fix_fracs(s: str) -> str:
    parts = s.split("\\frac")
    out = parts[0]
    for part in parts[1:]:
        out += "\\frac"
        # An empty part (string ending in \frac) raises IndexError, as in Hendrycks → raw comparison.
        if part[0] == "{":
            out += part
            continue
        if len(part) < 2:
            # Hendrycks gives up on the whole string here.
            return s
        a, b, rest = part[0], part[1], part[2:]
        out += "{" + a + "}{" + b + "}" + rest if b != "{" else "{" + a + "}" + b + rest
    return out


def _fix_a_slash_b(s: str) -> str:
    parts = s.split("/")
    if len(parts) != 2:
        return s
    try:
        a, b = int(parts[0]), int(parts[1])
    except ValueError:
        return s
    # Only canonical integers ("1/2", not "01/2" or "1/ 2") are rewritten.
    if s != f"{a}/{b}":
        return s
    return "\\frac{" + str(a) + "}{" + str(b) + "}"


def _remove_right_units(s: str) -> str:
    # In MATH, "\text{ " (with a space) only ever introduces units on the right.
    if "\\text{ " in s:
        parts = s.split("\\text{ ")
        if len(parts) != 2:
            # Hendrycks asserts here; the assertion error sends is_equiv to raw comparison.
            raise ValueError("more than one unit")
        return parts[0]
    return s


def _fix_sqrt(s: str) -> str:
    if "\\sqrt" not in s:
        return s
    parts = s.split("\\sqrt")
    out = parts[0]
    for part in parts[1:]:
        # An empty part (string ending in \sqrt) raises IndexError in Hendrycks too → raw comparison.
        out += "\\sqrt" + part if part[0] == "{" else "\\sqrt{" + part[0] + "}" + part[1:]
    return out


def strip_string(s: str) -> str:
    """Hendrycks `_strip_string`, step for step (order matters: e.g. `=` is split before spaces are removed)."""
    s = s.replace("\n", "")
    s = s.replace("\\!", "")
    s = s.replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "")
    s = s.replace("\\$", "")
    s = _remove_right_units(s)
    s = s.replace("\\%", "").replace("%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    halves = s.split("=")
    if len(halves) == 2 and len(halves[0]) <= 2:
        s = halves[1]
    s = _fix_sqrt(s)
    s = s.replace(" ", "")
    s = _fix_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _fix_a_slash_b(s)


def is_equiv_exact(prediction: str, gold: str) -> bool:
    """Hendrycks `is_equiv`: normalised equality; raw equality if the normaliser fails on either side."""
    try:
        return strip_string(prediction) == strip_string(gold)
    except (IndexError, ValueError):
        return prediction == gold


# ---------------------------------------------------------------------------------------------------------------
# math-verify equivalence
# ---------------------------------------------------------------------------------------------------------------


def is_equiv_math_verify(prediction: str, gold: str) -> bool:
    """math-verify's `verify(gold, pred)` on both answers parsed as `\\boxed{...}` LaTeX."""
    from math_verify import LatexExtractionConfig, parse, verify

    # math-verify bounds parse/verify time with SIGALRM, which only works in the main thread; elsewhere
    # (e.g. a scoring thread pool) it must run without its timeout.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    config = [LatexExtractionConfig()]
    gold_parsed = parse("\\boxed{" + gold + "}", extraction_config=config, parsing_timeout=timeout)
    pred_parsed = parse("\\boxed{" + prediction + "}", extraction_config=config, parsing_timeout=timeout)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=timeout))


# ---------------------------------------------------------------------------------------------------------------
# Registered scorers
# ---------------------------------------------------------------------------------------------------------------


@register("math_exact")
def math_exact(prediction: str, answers: list[str]) -> float:
    """KeyDiff "Exact Match": last boxed answer equals a gold under the Hendrycks MATH normaliser."""
    boxed = last_boxed(prediction)
    if boxed is None:
        return 0.0
    return float(any(is_equiv_exact(boxed, gold) for gold in answers))


@register("math_equiv")
def math_equiv(prediction: str, answers: list[str]) -> float:
    """KeyDiff "Flex Match": last boxed answer is exact-equal or math-verify-equivalent to a gold."""
    boxed = last_boxed(prediction)
    if boxed is None:
        return 0.0
    return float(any(is_equiv_exact(boxed, gold) or is_equiv_math_verify(boxed, gold) for gold in answers))
