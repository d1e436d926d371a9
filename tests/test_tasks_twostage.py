"""2StageRetr: the OmniKV generator's structure, strings, seeding, the long extension and the configs."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import hydra.utils
import pytest
from omegaconf import OmegaConf

from kvbench.tasks.base import whitespace_meter
from kvbench.tasks.metrics import COLOURS
from kvbench.tasks.scoring import score
from kvbench.tasks.twostage_retr import TwoStageRetr

CONF = Path(__file__).resolve().parents[1] / "kvbench" / "conf" / "task"
INSTRUCTION = ("Let's play a game. You have a dict and a mathematical addition equation. The keys of a dictionary "
               "can be any number. You need to find the corresponding key value in the dictionary after performing "
               "the addition and output the value corresponding to that key.")


def parse(sample) -> tuple[dict, int, int]:
    assert sample.context.startswith(INSTRUCTION + " The Dict is {") and sample.context.endswith("}\n")
    table = ast.literal_eval(sample.context[len(INSTRUCTION + " The Dict is "):-1])
    a, b = map(int, re.match(r"The equation is (\d+) \+ (\d+) = \?\n", sample.turns[0].question).groups())
    return table, a, b


def test_paper_variant_structure():
    samples = TwoStageRetr().samples(whitespace_meter, 0)
    assert len(samples) == 100
    assert [s.meta["dict_size"] for s in samples[:12]] == [40, 50, 60, 70, 80, 90, 100, 140, 180, 200, 40, 50]
    for s in samples:
        table, a, b = parse(s)
        key = s.meta["key"]
        assert list(table) == list(range(s.meta["dict_size"])) and set(table.values()) <= set(COLOURS)
        assert a + b == key and 0 <= a <= key and (a, b) == (s.meta["a"], s.meta["b"])
        assert s.turns[0].answers == [table[key]]
        assert s.context[s.meta["key_char_offset"]:].startswith(f"{key}: '{table[key]}'")
        assert s.turns[0].metric == "substring_ci" and s.meta["extra_metrics"] == ["last_colour_match"]
        assert s.turns[0].max_new_tokens == 200 and s.meta["total_tokens"] <= 4096
    assert len({s.meta["key"] for s in samples}) > 20  # keys spread over the dictionaries


def test_cot_and_direct_strings():
    cot = TwoStageRetr(num_samples=1).samples(whitespace_meter, 0)[0]
    assert cot.turns[0].question.endswith("= ?\nMUST first output the result of the addition, and then answer the "
                                          "corresponding value based on the result.")
    assert cot.turns[0].answer_prefix == ("First, for a precise answer, we can break down this multi-hop question "
                                          "into two to four sub-questions, as follows:")
    direct = TwoStageRetr(num_samples=1, cot=False).samples(whitespace_meter, 0)[0]
    assert direct.turns[0].question.endswith("= ?\nDirectly answer the corresponding color based on the equation result.")
    assert direct.turns[0].answer_prefix == ("The equation result should be used as a key to find the value in the "
                                             "dictionary.\nThen, i will directly give the color. The corresponding color is")
    assert direct.context == cot.context  # same seeded dictionary, only the tail differs


def test_unquoted_dictionary():
    s = TwoStageRetr(num_samples=1, quote_values=False).samples(whitespace_meter, 0)[0]
    assert "'" not in s.context.split("The Dict is ", 1)[1]
    assert re.fullmatch(r"\{0: [a-z]+(, \d+: [a-z]+)*\}\n", s.context.split("The Dict is ", 1)[1])
    key = s.meta["key"]
    assert s.context[s.meta["key_char_offset"]:].startswith(f"{key}: {s.turns[0].answers[0]}")


def test_seeding():
    first = TwoStageRetr(num_samples=5).samples(whitespace_meter, 7)
    assert [s.to_dict() for s in first] == [s.to_dict() for s in TwoStageRetr(num_samples=5).samples(whitespace_meter, 7)]
    assert [s.to_dict() for s in TwoStageRetr(num_samples=3).samples(whitespace_meter, 7)] == [s.to_dict() for s in first[:3]]
    assert [s.context for s in TwoStageRetr(num_samples=5).samples(whitespace_meter, 8)] != [s.context for s in first]


def test_long_variant_fills_seq_len():
    samples = TwoStageRetr(name="twostage_retr_long", seq_len=3000, num_samples=4, sizes=None).samples(whitespace_meter, 0)
    for s in samples:
        table, a, b = parse(s)
        per_entry = s.meta["total_tokens"] / len(table)
        assert s.meta["benchmark"] == "2stageretr_long" and len(table) > 200
        assert 3000 - (max(1, len(table) // 100) + 1) * per_entry - 8 <= s.meta["total_tokens"] <= 3000
        assert s.turns[0].answers == [table[a + b]]


def test_paper_variant_rejects_a_too_small_seq_len():
    with pytest.raises(ValueError, match="seq_len"):
        TwoStageRetr(seq_len=300).samples(whitespace_meter, 0)


def test_strict_and_lenient_scores_on_gold():
    s = TwoStageRetr(num_samples=1).samples(whitespace_meter, 0)[0]
    gold = s.turns[0].answers[0]
    answer = f"{s.meta['a']} + {s.meta['b']} = {s.meta['key']}, so the colour is {gold}."
    assert score("substring_ci", answer, [gold]) == score("last_colour_match", answer, [gold]) == 1.0


def test_configs_instantiate():
    paper = hydra.utils.instantiate(OmegaConf.load(CONF / "twostage_retr.yaml"))
    assert isinstance(paper, TwoStageRetr) and paper.name == "twostage_retr" and paper.num_samples == 100
    assert paper.sizes == [40, 50, 60, 70, 80, 90, 100, 140, 180, 200] and paper.cot and paper.quote_values
    long = hydra.utils.instantiate(OmegaConf.load(CONF / "twostage_retr_long.yaml"))
    assert long.name == "twostage_retr_long" and long.sizes is None and long.seq_len == 16384
