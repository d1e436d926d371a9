"""Scorers of the synthetic tasks against hand-computed values (RULER, passkey, 2StageRetr)."""

from __future__ import annotations

import pytest

from kvbench.tasks.metrics import ruler_postprocess
from kvbench.tasks.scoring import get_scorer, score

NAMES = ["string_match_all", "string_match_part", "passkey_exact_match", "passkey_partial_match", "substring_ci",
         "last_colour_match"]


def test_all_registered():
    for name in NAMES:
        assert callable(get_scorer(name))


def test_ruler_postprocess_replaces_control_characters_by_newlines():
    # RULER's evaluate.py: strip, re.sub(r"[\x00-\x1f]", "\n"), strip.
    assert ruler_postprocess("  ab\x01cd\t \n") == "ab\ncd"
    assert ruler_postprocess("\x00\x1f 42 \x07") == "42"
    assert ruler_postprocess("x\x7fy") == "x\x7fy"  # DEL is outside \x00-\x1f


@pytest.mark.parametrize("pred, refs, expected", [
    ("The numbers are 123 and 456.", ["123", "456", "789"], 2 / 3),
    ("APPLE pie", ["apple"], 1.0),  # case-insensitive both ways
    ("apple pie", ["Apple", "PIE"], 1.0),
    ("nothing here", ["a1", "b2"], 0.0),
    ("\x00 1234567 \x1f", ["1234567"], 1.0),  # control characters at the ends are stripped
    ("12\x0034", ["1234"], 0.0),  # ... and inside they become a newline, which breaks the match
    ("VAR AAA VAR BBB", ["AAA", "BBB", "CCC", "DDD"], 0.5),
])
def test_string_match_all(pred, refs, expected):
    assert score("string_match_all", pred, refs) == pytest.approx(expected)


@pytest.mark.parametrize("pred, refs, expected", [
    ("Paris", ["paris", "the city of Paris"], 1.0),  # any one reference is enough
    ("It is in France", ["Paris", "Lyon"], 0.0),
    ("  \x02The Denver BRONCOS\n", ["Denver Broncos"], 1.0),
    ("Denver", ["Denver Broncos"], 0.0),  # the reference must be inside the prediction, not the reverse
])
def test_string_match_part(pred, refs, expected):
    assert score("string_match_part", pred, refs) == expected


def test_scorers_reject_empty_references():
    for name in NAMES:
        with pytest.raises(ValueError):
            score(name, "anything", [])


@pytest.mark.parametrize("pred, refs, expected", [
    ("The pass key is 0123456. Remember it.", ["0123456"], 1.0),
    ("the pass key is 1,234,567", ["1234567"], 1.0),  # punctuation is dropped before matching
    ("The pass key is 1234 567", ["1234567"], 0.0),
    ("7654321", ["1234567"], 0.0),
    ("PASS KEY: ABC-12", ["abc12"], 1.0),
])
def test_passkey_exact_match(pred, refs, expected):
    assert score("passkey_exact_match", pred, refs) == expected


def test_passkey_partial_match_is_longest_common_substring_over_key_length():
    assert score("passkey_partial_match", "The pass key is 1234000.", ["1234567"]) == pytest.approx(4 / 7)
    assert score("passkey_partial_match", "1234567", ["1234567"]) == 1.0
    assert score("passkey_partial_match", "no digits", ["1234567"]) == 0.0
    assert score("passkey_partial_match", "xx567", ["1234567", "56"]) == 1.0  # max over golds


@pytest.mark.parametrize("pred, expected", [
    ("9 + 14 = 23, and key 23 is Teal.", 1.0),
    ("The answer is to steal it.", 1.0),  # OmniKV's lenient rule: a substring is enough
    ("23 maps to olive", 0.0),
])
def test_substring_ci(pred, expected):
    assert score("substring_ci", pred, ["teal"]) == expected


@pytest.mark.parametrize("pred, gold, expected", [
    ("9 + 14 = 23, and key 23 is teal.", "teal", 1.0),
    ("The answer is to steal it.", "teal", 0.0),  # whole words only
    ("Key 22 is red and key 23 is BLUE.", "blue", 1.0),  # the last colour named decides
    ("Key 23 is blue, not red.", "blue", 0.0),
    ("It is required that I consider it.", "red", 0.0),
    ("I cannot tell.", "red", 0.0),
    ("The value is mauve.", "mauve", 1.0),  # golds outside the 23 colours are candidates too
])
def test_last_colour_match(pred, gold, expected):
    assert score("last_colour_match", pred, [gold]) == expected
