"""LongBench task and metrics: vendored protocol files, prompt assembly, loader, and hand-computed scores."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest

from kvbench.tasks import longbench as lb
from kvbench.tasks import longbench_metrics as lm
from kvbench.tasks.base import DatasetMissingError, Sample, whitespace_meter
from kvbench.tasks.scoring import SCORERS

CONF_DIR = Path(__file__).resolve().parents[1] / "kvbench" / "conf"

# LongBench's per-task generation lengths (its config/dataset2maxlen.json; an independent transcription).
SPEC_MAX_NEW_TOKENS = {
    "narrativeqa": 128, "qasper": 128, "multifieldqa_en": 64, "multifieldqa_zh": 64, "hotpotqa": 32,
    "2wikimqa": 32, "musique": 32, "dureader": 128, "gov_report": 512, "qmsum": 512, "multi_news": 512,
    "vcsum": 512, "trec": 64, "triviaqa": 32, "samsum": 128, "lsht": 64, "passage_count": 32,
    "passage_retrieval_en": 32, "passage_retrieval_zh": 32, "lcc": 64, "repobench-p": 64,
}  # fmt: skip

TREC_CLASSES = ["Individual", "City", "Country", "Other location", "Definition of something"]
LSHT_CLASSES = ["体育", "财经", "娱乐"]


def make_row(subset: str, i: int) -> dict:
    """A hand-written row in the LongBench jsonl format; braces in the text check that format() leaves them."""
    zh = subset in lm.CHINESE_SUBSETS
    row = {
        "input": f"Question {i} about {{braces}}?" if not zh else f"第{i}个问题是什么？",
        "context": f"Document {i} text with {{context}} and {{input}} literally.\nSecond line." if not zh
        else f"第{i}篇文章。北京是中国的首都。",
        "answers": [f"answer {i}"],
        "length": 1000 * (i + 1),
        "dataset": subset,
        "language": "zh" if zh else "en",
        "all_classes": None,
        "_id": hashlib.sha1(f"{subset}-{i}".encode()).hexdigest()[:16],
    }
    if subset == "trec":
        row.update(input="Question: Who wrote Hamlet?\nType:", answers=["Individual"], all_classes=TREC_CLASSES)
    elif subset == "lsht":
        row.update(input="新闻：比赛结束。\n类别：", answers=["体育"], all_classes=LSHT_CLASSES)
    elif subset == "passage_retrieval_en":
        row.update(answers=[f"Paragraph {i + 1}"])
    elif subset == "passage_retrieval_zh":
        row.update(answers=[f"段落{i + 1}"])
    elif subset == "passage_count":
        row.update(input="", answers=[str(i + 3)])
    elif subset in ("gov_report", "multi_news", "vcsum", "lcc"):
        row.update(input="")
    if subset in ("lcc", "repobench-p"):
        row.update(context="def f(x):\n    return {'k': x}\n", answers=["    y = f(1)"])
        if subset == "repobench-p":
            row.update(input="import os\nclass A:\n")
    return row


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    """Three rows per subset as <subset>.jsonl, and two per LongBench-E subset as <subset>_e.jsonl."""
    for subset in lm.ALL_SUBSETS:
        with (tmp_path / f"{subset}.jsonl").open("w", encoding="utf-8") as f:
            for i in range(3):
                f.write(json.dumps(make_row(subset, i), ensure_ascii=False) + "\n")
    for subset in lb.E_SUBSETS:
        with (tmp_path / f"{subset}_e.jsonl").open("w", encoding="utf-8") as f:
            for i in (5, 6):
                f.write(json.dumps(make_row(subset, i), ensure_ascii=False) + "\n")
    return tmp_path


def full_prompt(sample: Sample) -> str:
    turn = sample.turns[0]
    return sample.context + turn.question + turn.answer_prefix


# ---------------------------------------------------------------------------------------------------------
# Vendored protocol files and subset tables
# ---------------------------------------------------------------------------------------------------------


def test_vendored_configs_are_pinned() -> None:
    # The prompt strings are the protocol: any edit must be deliberate (update the hash and the README).
    digests = {
        name: hashlib.sha256((lb._CONFIG_DIR / name).read_bytes()).hexdigest()
        for name in ("dataset2prompt.json", "dataset2maxlen.json")
    }
    assert digests == {
        "dataset2prompt.json": "5c1231ee6c3f198b0021e9c1ab9b66cbbfb52c432e0ed821a5afe89eefa17fd8",
        "dataset2maxlen.json": "75301d9cacf912e967c775997c94d9f021d176f940cb2d0318b99567220f52fb",
    }
    assert lb.MAX_NEW_TOKENS == SPEC_MAX_NEW_TOKENS
    assert set(lb.PROMPTS) == set(lm.ALL_SUBSETS)
    # The official typo stays: changing it changes model inputs.
    assert "asconcisely" in lb.PROMPTS["narrativeqa"]


def test_subset_tables() -> None:
    assert len(lm.ALL_SUBSETS) == 21 and len(lm.ENGLISH_SUBSETS) == 16
    assert "lcc" in lm.ENGLISH_SUBSETS and "repobench-p" in lm.ENGLISH_SUBSETS
    assert set(lb.E_SUBSETS) <= set(lm.ENGLISH_SUBSETS) and len(lb.E_SUBSETS) == 13


@pytest.mark.parametrize("subset", lm.ALL_SUBSETS)
def test_template_split_reassembles(subset: str) -> None:
    context_t, question_t, cue = lb.TEMPLATE_PARTS[subset]
    assert context_t + question_t + cue == lb.PROMPTS[subset]
    assert context_t.count("{context}") == 1 and "{input}" not in context_t
    assert "{context}" not in question_t + cue


def test_split_points_follow_kvpress() -> None:
    # Reminder instructions stay in the context part; the question part starts at the question marker.
    context_t, question_t, cue = lb.TEMPLATE_PARTS["narrativeqa"]
    assert context_t.endswith("Do not provide any explanation.") and "Now, answer" in context_t
    assert (question_t, cue) == ("\n\nQuestion: {input}\n\n", "Answer:")
    assert lb.TEMPLATE_PARTS["gov_report"][1:] == ("\n\n", "Summary:")
    assert lb.TEMPLATE_PARTS["passage_retrieval_en"][0].endswith("The following is an abstract.")
    assert lb.TEMPLATE_PARTS["passage_retrieval_en"][2] == "The answer is: "
    assert lb.TEMPLATE_PARTS["lcc"][1:] == ("", "Next line of code:\n")
    assert lb.TEMPLATE_PARTS["repobench-p"][1:] == ("{input}", "Next line of code:\n")
    assert lb.TEMPLATE_PARTS["trec"][1:] == ("\n{input}", "")


# ---------------------------------------------------------------------------------------------------------
# Samples
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("placement", ["user", "assistant"])
def test_prompt_equals_official_template(data_dir: Path, placement: str) -> None:
    task = lb.LongBench(subsets=list(lm.ALL_SUBSETS), data_dir=str(data_dir), prefix_placement=placement)
    samples = task.samples(whitespace_meter, seed=0)
    assert len(samples) == 21 * 3
    rows = task.load_rows()
    for sample in samples:
        subset = sample.meta["subset"]
        row = next(r for r in rows[subset] if r["_id"] == sample.meta["source_id"])
        assert full_prompt(sample) == lb.PROMPTS[subset].format(**row)
        assert row["context"] in sample.context
        cue = lb.TEMPLATE_PARTS[subset][2]
        if placement == "user":
            assert sample.turns[0].answer_prefix == "" and sample.turns[0].question.endswith(cue)
        else:
            assert sample.turns[0].answer_prefix == cue


def test_question_part_holds_the_query(data_dir: Path) -> None:
    task = lb.LongBench(subsets=["hotpotqa", "repobench-p", "trec"], num_samples=1, data_dir=str(data_dir))
    by_subset = {s.meta["subset"]: s for s in task.samples(whitespace_meter, seed=0)}
    hotpot = by_subset["hotpotqa"]
    assert hotpot.turns[0].question == "\n\nQuestion: Question 0 about {braces}?\nAnswer:"
    assert "Question 0" not in hotpot.context
    assert by_subset["repobench-p"].turns[0].question == "import os\nclass A:\nNext line of code:\n"
    assert by_subset["trec"].turns[0].question == "\nQuestion: Who wrote Hamlet?\nType:"


def test_sample_fields(data_dir: Path) -> None:
    task = lb.LongBench(subsets=list(lm.ALL_SUBSETS), data_dir=str(data_dir))
    for s in task.samples(whitespace_meter, seed=0):
        subset = s.meta["subset"]
        turn = s.turns[0]
        assert s.task == f"longbench_{subset}" and s.id == f"longbench_{subset}/{s.meta['source_id']}"
        assert s.truncation == "middle"
        assert s.chat_template == (subset not in ("trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"))
        assert s.stop == (["\n"] if subset == "samsum" else [])
        assert turn.max_new_tokens == SPEC_MAX_NEW_TOKENS[subset]
        assert turn.metric in SCORERS
        assert s.meta["language"] == ("zh" if subset in lm.CHINESE_SUBSETS else "en")
        assert ("min_new_tokens" in s.meta) == (subset == "samsum")
        assert Sample.from_dict(json.loads(json.dumps(s.to_dict()))) == s
    metrics = {s.meta["subset"]: s.turns[0].metric for s in task.samples(whitespace_meter, seed=0)}
    assert metrics["triviaqa"] == "longbench_qa_f1_first_line"
    assert metrics["samsum"] == "longbench_rouge_first_line"
    assert metrics["qasper"] == "longbench_qa_f1" and metrics["multifieldqa_zh"] == "longbench_qa_f1_zh"
    assert metrics["dureader"] == metrics["vcsum"] == "longbench_rouge_zh"
    assert metrics["lcc"] == metrics["repobench-p"] == "longbench_code_sim"
    assert metrics["trec"] == "longbench_classification_first_line"
    trec = next(s for s in task.samples(whitespace_meter, seed=0) if s.meta["subset"] == "trec")
    assert trec.turns[0].metric_args == {"all_classes": TREC_CLASSES}


def test_gold_answers_score_full_marks(data_dir: Path) -> None:
    task = lb.LongBench(subsets=list(lm.ALL_SUBSETS), data_dir=str(data_dir))
    for s in task.samples(whitespace_meter, seed=0):
        turn = s.turns[0]
        assert SCORERS[turn.metric](turn.answers[0], turn.answers, **turn.metric_args) == pytest.approx(1.0, abs=1e-6), s.task


def test_loader_reads_data_subdir_num_samples_and_e(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    parent = tmp_path_factory.mktemp("unzipped")
    (parent / "data").symlink_to(data_dir)  # data.zip unpacks into data/
    task = lb.LongBench(subsets=["qasper", "lcc"], num_samples=2, data_dir=str(parent))
    samples = task.samples(whitespace_meter, seed=0)
    assert [s.meta["source_id"] for s in samples] == [
        make_row(sub, i)["_id"] for sub in ("qasper", "lcc") for i in (0, 1)
    ]
    e_task = lb.LongBench(e=True, data_dir=str(data_dir))
    e_samples = e_task.samples(whitespace_meter, seed=0)
    assert len(e_samples) == 13 * 2
    assert {s.meta["length"] for s in e_samples} == {6000, 7000}  # rows 5 and 6 of the _e files
    assert all(s.task.startswith("longbench_e_") and s.meta["longbench_e"] for s in e_samples)


def test_default_subsets_are_the_16_english(data_dir: Path) -> None:
    task = lb.LongBench(data_dir=str(data_dir))
    assert task.subsets == list(lm.ENGLISH_SUBSETS)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="LongBench-E"):
        lb.LongBench(subsets=["narrativeqa"], e=True)
    with pytest.raises(ValueError, match="not in LongBench"):
        lb.LongBench(subsets=["qasper_e"])
    with pytest.raises(ValueError, match="prefix_placement"):
        lb.LongBench(prefix_placement="both")


def test_missing_data_dir_files_name_the_fix(tmp_path: Path) -> None:
    (tmp_path / "qasper.jsonl").write_text(json.dumps(make_row("qasper", 0)) + "\n", encoding="utf-8")
    task = lb.LongBench(subsets=["qasper", "hotpotqa", "lcc"], data_dir=str(tmp_path))
    with pytest.raises(DatasetMissingError) as err:
        task.samples(whitespace_meter, seed=0)
    msg = str(err.value)
    assert "THUDM/LongBench" in msg and "hotpotqa, lcc" in msg and "qasper," not in msg
    assert "data.zip" in msg and "unzip" in msg and "task.data_dir=" in msg


def test_missing_hf_cache_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path)
    with pytest.raises(DatasetMissingError, match="HF datasets cache"):
        lb.LongBench(subsets=["qasper"], e=True).load_rows()


def test_malformed_row_is_rejected(tmp_path: Path) -> None:
    (tmp_path / "qasper.jsonl").write_text(json.dumps({"input": "q", "context": "c"}) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match="qasper.jsonl:1"):
        lb.LongBench(subsets=["qasper"], data_dir=str(tmp_path)).load_rows()


@pytest.mark.parametrize(("config", "n"), [("longbench", 16 * 3), ("longbench_all", 21 * 3), ("longbench_e", 13 * 2)])
def test_hydra_configs_instantiate(data_dir: Path, config: str, n: int) -> None:
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(overrides=[f"+task={config}", f"task.data_dir={data_dir}"])
    task = instantiate(cfg.task)
    assert isinstance(task, lb.LongBench) and task.name == config
    assert len(task.samples(whitespace_meter, seed=0)) == n


# ---------------------------------------------------------------------------------------------------------
# Scorers (hand-computed values)
# ---------------------------------------------------------------------------------------------------------


def test_qa_f1() -> None:
    f1 = SCORERS["longbench_qa_f1"]
    assert f1("The Eiffel Tower!", ["eiffel tower"]) == 1.0  # case, punctuation, article
    assert f1("in Paris France", ["Paris"]) == pytest.approx(0.5)  # P=1/3, R=1
    assert f1("London", ["Berlin"]) == 0.0
    assert f1("Paris", ["London", "Paris", "Rome"]) == 1.0  # max over gold answers
    assert f1("anything", []) == 0.0
    assert f1("a an the", ["the"]) == 0.0  # both normalise to nothing


def test_first_line_cut() -> None:
    assert lm.first_line("\n\nParis\nQuestion: London?") == "Paris"
    assert lm.first_line(" \nParis") == " "  # only newlines are stripped
    pred = "\n\nParis\nQuestion: Where is Big Ben?\nAnswer: London"
    assert SCORERS["longbench_qa_f1_first_line"](pred, ["London"]) == 0.0
    assert SCORERS["longbench_qa_f1"](pred, ["London"]) > 0.0
    assert SCORERS["longbench_qa_f1_first_line"](pred, ["Paris"]) == 1.0
    summary = "Amy is late.\nDialogue: Bob: hi"
    assert SCORERS["longbench_rouge_first_line"](summary, ["Amy is late."]) == pytest.approx(1.0, abs=1e-6)


def test_qa_f1_zh_uses_jieba_words() -> None:
    f1 = SCORERS["longbench_qa_f1_zh"]
    # jieba: 北京/是/中国/的/首都/。 -> 5 words after dropping "。"; gold 北京 -> P=1/5, R=1.
    assert f1("北京是中国的首都。", ["北京"]) == pytest.approx(1 / 3)
    # jieba: 今天天气/很/好 vs 天气/很/好 -> 2 common words of 3 each (characters would give 4 of 6 vs 4).
    assert f1("今天天气很好", ["天气很好"]) == pytest.approx(2 / 3)
    assert f1("，。！", ["北京"]) == 0.0


def test_rouge_is_pltrdy_rouge_l() -> None:
    rouge = SCORERS["longbench_rouge"]
    # pltrdy counts unique words: {the,cat,sat,on,mat} vs {the,cat,lay,on,mat}, LCS words {the,cat,on,mat}
    # -> P = R = 4/5, F = 0.8 (rouge-score would give 5/6).
    assert rouge("the cat sat on the mat", ["the cat lay on the mat"]) == pytest.approx(0.8, abs=1e-6)
    assert rouge("", ["a summary"]) == 0.0  # the library raises on an empty hypothesis
    assert rouge("...", ["a summary"]) == 0.0
    assert rouge("x y", ["no overlap", "x y"]) == pytest.approx(1.0, abs=1e-6)
    assert SCORERS["longbench_rouge_zh"]("今天天气很好", ["今天天气很好"]) == pytest.approx(1.0, abs=1e-6)
    # 今天天气/很/好 vs 天气/很/好: LCS 2 of 3 unique words each.
    assert SCORERS["longbench_rouge_zh"]("今天天气很好", ["天气很好"]) == pytest.approx(2 / 3, abs=1e-6)


def test_retrieval_and_count() -> None:
    ret = SCORERS["longbench_retrieval"]
    assert ret("Paragraph 12", ["Paragraph 12"]) == 1.0
    assert ret("Paragraph 12, or maybe Paragraph 3", ["Paragraph 12"]) == 0.5
    assert ret("Paragraph 30", ["Paragraph 3"]) == 0.0  # whole numbers, not substrings
    assert ret("I do not know", ["Paragraph 3"]) == 0.0
    assert SCORERS["longbench_retrieval_zh"]("答案是段落5，不是段落15", ["段落5"]) == 0.5
    count = SCORERS["longbench_count"]
    assert count("There are 7 unique paragraphs out of 10", ["7"]) == 0.5
    assert count("07", ["7"]) == 0.0  # string comparison
    assert count("7", ["7"]) == 1.0
    with pytest.raises(ValueError, match="Paragraph"):
        ret("1", ["first paragraph"])


def test_code_sim_fuzzywuzzy_rounding_and_backend() -> None:
    sim = SCORERS["longbench_code_sim"]
    # First line without ` # // is "    x = foo(1)": 2*10/(14+10) = 0.8333 -> fuzz.ratio 83.
    assert sim("\n\n```python\n# call foo\n    x = foo(1)\n", ["x = foo(1)"]) == 0.83
    # Integer rounding is Python's half-to-even: LCS 1 of 16 chars = 12.5 -> 12; 3 of 16 = 37.5 -> 38.
    assert sim("abcdefgh", ["aijklmno"]) == 0.12
    assert sim("abcdefgh", ["abcijklm"]) == 0.38
    # Levenshtein backend (python-Levenshtein): 46; difflib's SequenceMatcher would give 31.
    assert sim("ccbcaa", ["bcbbbcc"]) == 0.46
    assert sim("// only comments\n# here", ["x = 1"]) == 0.0  # no usable line -> "" -> 0
    assert sim("x = 1", ["y = 2", "x = 1"]) == 1.0


def test_classification_quirks() -> None:
    classes = ["art", "part", "party", "cat"]

    def score(prediction: str, answers: list[str]) -> float:
        return SCORERS["longbench_classification_first_line"](prediction, answers, all_classes=classes)

    # Matches [art, part, party, cat]; removing "art" (a substring of the gold) while iterating skips "part",
    # which stays: [part, party, cat] -> 1/3 (a correct removal would give 1/2).
    assert score("party cat", ["party"]) == pytest.approx(1 / 3)
    assert lm.classification_score("party cat", "party", classes) == pytest.approx(1 / 3)
    # A class that contains the gold still counts as a match: [art, party] -> 1/2.
    assert lm.classification_score("party", "art", ["art", "party"]) == 0.5
    assert score("nothing relevant", ["cat"]) == 0.0  # the difflib fallback never runs
    assert score("cat\nparty", ["cat"]) == 1.0  # first line only
    assert score("\ncat", ["cat"]) == 1.0


def test_subset_score_and_e_buckets() -> None:
    assert lm.longbench_subset_score([1.0, 0.0, 0.5]) == 50.0
    assert lm.longbench_subset_score([1 / 3]) == 33.33
    buckets = lm.longbench_e_buckets([1.0, 0.0, 0.5, 1.0], [100, 3999, 4000, 9000])
    assert buckets == {"0-4k": 50.0, "4-8k": 50.0, "8k+": 100.0}
    assert math.isnan(lm.longbench_e_buckets([1.0], [10])["8k+"])


def test_averages() -> None:
    scores = {s: 10.0 for s in lm.ENGLISH_SUBSETS} | {"passage_count": 2.0}
    avg = lm.longbench_averages(scores)
    assert avg["en16_mean"] == 9.5  # (15*10 + 2) / 16
    assert avg["rocketkv_lb_avg"] == 10.0  # passage_count excluded
    assert avg["subset_mean"] == 9.5
    assert avg["category/synthetic"] == 6.0
    assert avg["category_mean"] == 9.33  # (5*10 + 6) / 6
    with_zh = lm.longbench_averages(scores | {"dureader": 40.0})
    assert with_zh["en16_mean"] == 9.5
    assert with_zh["category/multi_doc_qa"] == 17.5  # (10+10+10+40) / 4
    assert with_zh["category_mean"] == 10.58  # (10+17.5+10+10+6+10) / 6
    assert with_zh["subset_mean"] == 11.29  # 192 / 17
    partial = lm.longbench_averages({"qasper": 30.0, "lcc": 50.0})
    assert "en16_mean" not in partial and "rocketkv_lb_avg" not in partial
    assert partial["category_mean"] == 40.0
    with pytest.raises(ValueError, match="not LongBench"):
        lm.longbench_averages({"qasper_e": 1.0})
