"""NIAH passkey grid: prompt strings, needle at the requested depth, lengths under a meter, determinism."""

from __future__ import annotations

import json
import re
from pathlib import Path

import hydra.utils
import pytest
from omegaconf import OmegaConf
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from kvbench.tasks import haystack as hs
from kvbench.tasks.base import whitespace_meter
from kvbench.tasks.niah import Niah
from kvbench.tasks.scoring import score

CONF = Path(__file__).resolve().parents[1] / "kvbench" / "conf" / "task"
INSTRUCTION = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
               "I will quiz you about the important information there.\n")


@pytest.fixture(scope="module")
def bpe_meter():
    """A byte-level BPE meter with a toy chat template, built in code (no hub access)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=2000, special_tokens=["<|user|>", "<|assistant|>", "<|end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([hs.essay_text()[:100_000]], trainer)

    def meter(context: str, question: str = "", answer_prefix: str = "", chat_template: bool = True) -> int:
        text = f"<|user|>\n{context}{question}<|end|>\n<|assistant|>\n{answer_prefix}" if chat_template else context + question + answer_prefix
        return len(tok.encode(text).ids)

    return meter


def grid(meter=whitespace_meter, seed: int = 0, **kw):
    kw = {"lengths": [600, 1500], "depths": [0, 25, 50, 100], "num_samples": 2, **kw}
    return Niah(**kw).samples(meter, seed)


def test_grid_shape_ids_and_determinism():
    samples = grid()
    assert len(samples) == 2 * 4 * 2 and len({s.id for s in samples}) == len(samples)
    assert [s.to_dict() for s in samples] == [s.to_dict() for s in grid()]
    assert [s.meta["passkey"] for s in grid(seed=1)] != [s.meta["passkey"] for s in samples]
    cell = [s for s in samples if s.meta["length"] == 600 and s.meta["depth"] == 25]
    assert cell[0].meta["passkey"] != cell[1].meta["passkey"]  # a fresh key per repetition
    for s in samples:
        assert s.task == "niah" and not s.chat_template
        assert re.fullmatch(r"\d{7}", s.meta["passkey"]) and s.turns[0].answers == [s.meta["passkey"]]
        assert s.turns[0].metric == "passkey_exact_match" and s.turns[0].max_new_tokens == 256
        assert s.meta["extra_metrics"] == ["passkey_partial_match"]
        json.dumps(s.to_dict())


def test_prompt_is_the_longctx_bench_string():
    s = grid(lengths=[200], length_unit="words", depths=[50], num_samples=1)[0]
    key = s.meta["passkey"]
    words = re.findall(r"[^\s]+[\s]*", hs.essay_text())[:200]
    before, after = "".join(words[:100]).strip(), "".join(words[100:]).strip()
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."
    full = s.context + s.turns[0].question + s.turns[0].answer_prefix
    assert full == INSTRUCTION + f"{before} {needle} {after} " + "\nWhat is the pass key? The pass key is "
    assert s.meta["background_words"] == 200 and s.meta["needle_word_index"] == 100


@pytest.mark.parametrize("depth", [0, 10, 33, 50, 90, 100])
def test_needle_at_requested_depth(depth):
    for s in grid(depths=[depth], num_samples=1):
        m = s.meta
        key = m["passkey"]
        assert s.context[m["needle_char_offset"]:m["needle_char_end"]] == f"The pass key is {key}. Remember it. {key} is the pass key."
        assert m["needle_word_index"] == int(m["background_words"] * depth / 100)
        # the background words before the needle are exactly needle_word_index
        assert len(s.context[len(INSTRUCTION):m["needle_char_offset"]].split()) == m["needle_word_index"]
        # token span (whitespace meter: words), from the start of the context part
        assert m["needle_token_offset"] == len(s.context[:m["needle_char_offset"]].split())
        assert m["needle_token_end"] - m["needle_token_offset"] == 12
        assert score("passkey_exact_match", s.context[m["needle_char_offset"]:m["needle_char_end"]], [key]) == 1.0


def test_token_lengths_fill_the_cell():
    for s in grid():
        m = s.meta
        per_word = m["total_tokens"] / m["background_words"]
        assert m["total_tokens"] <= m["length"]
        assert m["total_tokens"] >= m["length"] - (max(1, m["background_words"] // 100) + 1) * per_word - 16


def test_token_lengths_under_a_bpe_tokenizer(bpe_meter):
    samples = grid(meter=bpe_meter, lengths=[1024, 3000], depths=[0, 50, 100], chat_template=True)
    for s in samples:
        m = s.meta
        assert m["total_tokens"] == bpe_meter(s.context, s.turns[0].question, s.turns[0].answer_prefix) + 256
        assert m["length"] - 0.05 * m["length"] <= m["total_tokens"] <= m["length"]
    by_depth = sorted((s.meta["depth"], s.meta["needle_token_offset"]) for s in samples if s.meta["length"] == 3000)
    offsets = [o for _, o in by_depth]
    assert offsets == sorted(offsets) and offsets[0] < 50 < offsets[-1]


def test_noise_haystack_and_seq_len_default():
    samples = Niah(seq_len=800, depths=[50], num_samples=1, haystack="noise").samples(whitespace_meter, 0)
    (s,) = samples
    assert s.meta["length"] == 800 and "The grass is green." in s.context and "Paul" not in s.context


def test_invalid_settings():
    with pytest.raises(ValueError):
        Niah(depths=[120])
    with pytest.raises(ValueError):
        Niah(length_unit="characters")


def test_config_instantiates_with_overrides():
    cfg = OmegaConf.load(CONF / "niah.yaml")
    cfg.lengths = [700, 900]
    cfg.depths = [0, 100]
    task = hydra.utils.instantiate(cfg)
    assert isinstance(task, Niah) and task.name == "niah" and task.seq_len == 4096 and task.num_samples == 3
    assert task.lengths == [700, 900] and task.depths == [0, 100]
    assert len(task.samples(whitespace_meter, 0)) == 2 * 2 * 3
    assert hydra.utils.instantiate(OmegaConf.load(CONF / "niah.yaml")).lengths == [4096]
