"""SCBench task and scorers: prompt protocol, loader, configs, and hand-computed scores.

Fixture rows are written here in the released jsonl format ({id, context, multi_turns: [...]}); they are made up,
not copied from the dataset.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from kvbench.tasks import scbench as sc
from kvbench.tasks import scbench_metrics as sm
from kvbench.tasks.base import DatasetMissingError, whitespace_meter
from kvbench.tasks.scoring import SCORERS

CONF_DIR = Path(__file__).resolve().parents[1] / "kvbench" / "conf" / "task"

# SCBench's released harness (an independent transcription): max new tokens per turn sub-task and metric family.
SPEC_MAX_NEW_TOKENS = {
    "scbench_kv": {"scbench_kv": 150}, "scbench_prefix_suffix": {"scbench_prefix_suffix": 150},
    "scbench_vt": {"scbench_vt": 30}, "scbench_repoqa": {"scbench_repoqa": 1024},
    "scbench_qa_eng": {"scbench_qa_eng": 40}, "scbench_qa_chn": {"scbench_qa_chn": 40},
    "scbench_choice_eng": {"scbench_choice_eng": 40}, "scbench_many_shot": {"scbench_many_shot": 10},
    "scbench_summary": {"scbench_summary": 200}, "scbench_mf": {"scbench_mf": 5},
    "scbench_summary_with_needles": {"scbench_summary": 800, "scbench_passkey": 15},
    "scbench_repoqa_and_kv": {"scbench_repoqa": 1024, "scbench_kv": 80},
}  # fmt: skip

GOLD_FN = "def add_one(x):\n    return x + 1"
OTHER_FN = "def scale(values, factor):\n    return [v * factor for v in values]"
THIRD_FN = "def greet(name):\n    print('hello', name)"


def _turn(i: int, **extra) -> dict:
    return {"input": f"Question {i}?", "answer": f"answer-{i}", **extra}


def make_rows(task: str) -> list[dict]:
    """Two rows of the task in the released format, each with three turns."""
    rows = []
    for r in range(2):
        row = {"id": 10 + r, "context": f"Shared context {r} with {{braces}} kept."}
        if task == "scbench_kv":
            row["context"] = json.dumps({"k-a": "v-1", "k-b": "v-2"})
            row["multi_turns"] = [
                {"input": f'Key: "k-{c}"\nThe value associated with the specified key is: ', "answer": f"v-{n}"}
                for n, c in ((1, "a"), (2, "b"), (1, "a"))
            ]
        elif task == "scbench_vt":
            row["multi_turns"] = [_turn(i, answer=[f"X{i}", f"Y{i}"]) for i in range(3)]
        elif task == "scbench_choice_eng":
            opts = ["red fox", "blue whale", "green frog", "grey owl"]
            row["multi_turns"] = [_turn(i, options=opts, answer=opts[i]) for i in range(3)]
        elif task == "scbench_mf":
            row["context"] = [3, 1, 4, 1, 5]
            row["multi_turns"] = [
                {"input": "The largest number in the list is", "answer": 5},
                {"input": "The smallest number in the list is", "answer": 1},
                {"input": "The median of the list is", "answer": 3},
            ]
        elif task in ("scbench_repoqa", "scbench_repoqa_and_kv"):
            row.update(repo="acme/tools", lang="python")
            fns = [(GOLD_FN, "add_one"), (OTHER_FN, "scale"), (THIRD_FN if r else GOLD_FN, "greet" if r else "add_one")]
            turns = [{"input": f"Function {name} description.", "answer": fn, "name": name} for fn, name in fns]
            if task == "scbench_repoqa_and_kv":
                turns[1] = {"input": "Key k-z?", "answer": "v-z", "task": "scbench_kv"}
                for t in (turns[0], turns[2]):
                    t["task"] = "scbench_repoqa"
            row["multi_turns"] = turns
        elif task == "scbench_summary_with_needles":
            row["multi_turns"] = [
                _turn(0, task="scbench_summary"), _turn(1, answer="48213", task="scbench_passkey"),
                _turn(2, task="scbench_summary"),
            ]
        else:
            row["multi_turns"] = [_turn(i) for i in range(3)]
        rows.append(row)
    return rows


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    for task in sc.TASKS:
        with (tmp_path / f"{task}.jsonl").open("w", encoding="utf-8") as f:
            for row in make_rows(task):
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return tmp_path


def load(data_dir: Path, task: str, **kw):
    return sc.SCBench(name=task, tasks=[task], data_dir=str(data_dir), **kw).samples(whitespace_meter, 0)


# ---------------------------------------------------------------------------------------------------------------
# Prompt protocol
# ---------------------------------------------------------------------------------------------------------------


def test_kv_multi_turn_layout(data_dir: Path) -> None:
    samples = load(data_dir, "scbench_kv")
    assert [s.id for s in samples] == ["scbench_kv/0", "scbench_kv/1"]
    s = samples[0]
    ctx = json.dumps({"k-a": "v-1", "k-b": "v-2"})
    assert s.context == "Extract the value corresponding to the specified key in the JSON object below.\n\n" + ctx
    # Turn 1 continues the same user message ("{context}\n\n{input}"); later turns are bare follow-up messages.
    assert s.turns[0].question == '\n\nKey: "k-a"\nThe value associated with the specified key is: '
    assert s.turns[1].question == 'Key: "k-b"\nThe value associated with the specified key is: '
    assert [t.answers for t in s.turns] == [["v-1"], ["v-2"], ["v-1"]]
    assert {(t.max_new_tokens, t.metric, t.answer_prefix) for t in s.turns} == {(150, "scbench_substring", "")}
    assert (s.task, s.truncation, s.chat_template, s.stop) == ("scbench_kv", "middle", True, [])
    assert s.meta["mode"] == "multi_turn" and s.meta["golden_context"] is True
    assert s.meta["golden_answers"] == ["v-1", "v-2", "v-1"]
    assert s.meta["reserve_tokens"] == 150 * 3
    assert s.meta["prompt_token_limit"] == 100_000 - 450
    assert s.meta["category"] == "Retr.String" and s.meta["record_id"] == 10


def test_multi_request_layout_has_no_separator(data_dir: Path) -> None:
    s = load(data_dir, "scbench_kv", mode="multi_request")[0]
    assert s.context.startswith("Extract the value") and s.context.endswith('"v-2"}')
    # create_scdq_prompt splits one user message at the end of the context: the query follows directly.
    assert [t.question for t in s.turns] == [row["input"] for row in make_rows("scbench_kv")[0]["multi_turns"]]
    assert s.meta["mode"] == "multi_request"
    assert s.meta["reserve_tokens"] == 150 * 3 + 1000


def test_choice_prompts_and_answers(data_dir: Path) -> None:
    s = load(data_dir, "scbench_choice_eng")[0]
    assert s.context == "Read the book and answer the question.\n\nShared context 0 with {braces} kept."
    options = "A. red fox\nB. blue whale\nC. green frog\nD. grey owl"
    assert s.turns[0].question == f"\n\nQuestion: Question 0?\n{options}\n\nThe the correct answer is"
    assert s.turns[1].question == f"Question: Question 1?\n{options}\n\nThe the correct answer is"
    assert [t.answers for t in s.turns] == [["red fox", "A"], ["blue whale", "B"], ["green frog", "C"]]
    assert s.meta["golden_answers"] == ["red fox", "blue whale", "green frog"]


def test_qa_templates(data_dir: Path) -> None:
    eng = load(data_dir, "scbench_qa_eng")[0]
    assert eng.context.startswith("Read the book and answer the question. Be very concise in your answer.\n\n")
    assert eng.turns[0].question == "\n\nQuestion: Question 0?\nAnswer:"
    assert eng.turns[2].question == "Question: Question 2?\nAnswer:"
    chn = load(data_dir, "scbench_qa_chn")[0]
    assert chn.context.startswith("阅读以下书籍然后回答问题。\n\n")
    assert chn.turns[0].question == "\n\n问题：Question 0?\n答案："
    assert chn.turns[1].question == "问题：Question 1?\n答案："
    assert chn.turns[0].metric == "scbench_qa_f1_chars" and eng.turns[0].metric == "scbench_upper_substring"


def test_math_find_reference_quirks(data_dir: Path) -> None:
    s = load(data_dir, "scbench_mf")[0]
    # The integer list is rendered with str(list); turn 1 asks about its own target before the context.
    assert s.context == "What is the largest number in the list?\n\n[3, 1, 4, 1, 5]"
    assert s.turns[0].question == "\n\nThe largest number in the list is"
    # Chat-mode follow-ups all carry the target of the last turn (the reference's leaked loop variable).
    assert s.turns[1].question == "What is the median of the list?\n\nThe smallest number in the list is"
    assert s.turns[2].question == "What is the median of the list?\n\nThe median of the list is"
    assert [t.answers for t in s.turns] == [["5"], ["1"], ["3"]]
    mr = load(data_dir, "scbench_mf", mode="multi_request")[0]
    assert mr.context == "The largest number in the list is\n\n[3, 1, 4, 1, 5]"
    assert mr.turns[1].question == "What is the smallest number in the list?\n\nThe smallest number in the list is"


def test_summary_answer_prefix_only_on_follow_ups(data_dir: Path) -> None:
    s = load(data_dir, "scbench_summary")[0]
    assert [t.answer_prefix for t in s.turns] == ["", "This paper", "This paper"]
    assert s.context == "Shared context 0 with {braces} kept." and s.turns[0].question == "\n\nQuestion 0?"
    mr = load(data_dir, "scbench_summary", mode="multi_request")[0]
    assert [t.answer_prefix for t in mr.turns] == ["", "", ""]


def test_mixed_task_turns(data_dir: Path) -> None:
    s = load(data_dir, "scbench_summary_with_needles")[0]
    assert [(t.max_new_tokens, t.metric) for t in s.turns] == [
        (800, "scbench_rouge_lsum"), (15, "scbench_first_int"), (800, "scbench_rouge_lsum"),
    ]  # fmt: skip
    assert s.meta["turn_tasks"] == ["scbench_summary", "scbench_passkey", "scbench_summary"]
    assert s.meta["reserve_tokens"] == (800 + 15) * 3 // 2
    r = load(data_dir, "scbench_repoqa_and_kv")[0]
    assert [(t.max_new_tokens, t.metric) for t in r.turns] == [
        (1024, "scbench_repoqa_python"), (80, "scbench_substring"), (1024, "scbench_repoqa_python"),
    ]  # fmt: skip
    assert r.turns[1].answers == ["v-z"]


def test_repoqa_needle_pool_spans_rows(data_dir: Path) -> None:
    samples = load(data_dir, "scbench_repoqa")
    assert samples[0].context.startswith("Based on the function description and code context, please retrieve")
    # Needles of the repository over all evaluated rows and turns, first-seen order, one per distinct body.
    pool = [GOLD_FN, OTHER_FN, THIRD_FN]
    assert samples[0].turns[1].answers == [OTHER_FN, *pool]
    assert samples[1].turns[2].answers == [THIRD_FN, *pool]
    assert samples[0].meta["repo"] == "acme/tools" and samples[0].meta["lang"] == "python"
    # The pool follows the selection: with one row and two turns, THIRD_FN is not a needle.
    one = load(data_dir, "scbench_repoqa", num_samples=1, max_turns=2)
    assert len(one) == 1 and one[0].turns[0].answers == [GOLD_FN, GOLD_FN, OTHER_FN]
    # A model that returns the gold function in a fenced block passes; a neighbour's body does not.
    turn = samples[0].turns[0]
    assert SCORERS[turn.metric](f"Here it is:\n```python\n{GOLD_FN}\n```", turn.answers) == 1.0
    assert SCORERS[turn.metric](f"```python\n{OTHER_FN}\n```", turn.answers) == 0.0


def test_vt_golden_answer_is_python_repr(data_dir: Path) -> None:
    s = load(data_dir, "scbench_vt")[0]
    assert s.turns[0].answers == ["X0", "Y0"] and s.turns[0].metric == "scbench_string_match_all"
    assert s.meta["golden_answers"][0] == "['X0', 'Y0']"


def test_selection_options(data_dir: Path) -> None:
    samples = load(data_dir, "scbench_many_shot", num_samples=1, max_turns=2)
    assert len(samples) == 1 and len(samples[0].turns) == 2
    assert samples[0].meta["reserve_tokens"] == 10 * 2
    assert len(load(data_dir, "scbench_many_shot", max_turns=None)[0].turns) == 3
    with pytest.raises(ValueError, match="seq_len"):
        sc.SCBench(name="x", tasks=["scbench_kv"], seq_len=4096)
    with pytest.raises(ValueError, match="mode"):
        sc.SCBench(name="x", tasks=["scbench_kv"], mode="chat")
    with pytest.raises(ValueError, match="unknown SCBench task"):
        sc.SCBench(name="x", tasks=["scbench_passkey"])


def test_missing_data_names_the_dataset(tmp_path: Path) -> None:
    with pytest.raises(DatasetMissingError) as err:
        load(tmp_path, "scbench_kv")
    message = str(err.value)
    assert str(tmp_path / "scbench_kv.jsonl") in message
    assert "microsoft/SCBench" in message and "huggingface-cli download" in message
    assert "load_dataset('microsoft/SCBench', 'scbench_kv', split='test')" in message


def test_configs_instantiate_and_match_spec(data_dir: Path) -> None:
    names = sorted(p.stem for p in CONF_DIR.glob("scbench*.yaml"))
    assert names == sorted(["scbench", *sc.TASKS])
    for name in names:
        cfg = OmegaConf.load(CONF_DIR / f"{name}.yaml")
        cfg.data_dir = str(data_dir)
        task = instantiate(cfg)
        assert task.name == name and task.mode == "multi_turn" and task.max_turns == 5
        assert task.tasks == (list(sc.TASKS) if name == "scbench" else [name])
    assert {t: spec.max_new_tokens for t, spec in sc.TASKS.items()} == SPEC_MAX_NEW_TOKENS
    suite = instantiate(OmegaConf.merge(OmegaConf.load(CONF_DIR / "scbench.yaml"), {"data_dir": str(data_dir)}))
    samples = suite.samples(whitespace_meter, 0)
    assert len(samples) == 2 * len(sc.TASKS)
    # Every turn names a registered scorer, and the golden answer the history would show scores 1 on its turn.
    for s in samples:
        for golden, turn in zip(s.meta["golden_answers"], s.turns):
            assert SCORERS[turn.metric](golden, turn.answers) == 1.0, (s.id, turn.metric)


# ---------------------------------------------------------------------------------------------------------------
# Scorers, against hand-computed values
# ---------------------------------------------------------------------------------------------------------------


def test_substring_rules() -> None:
    assert SCORERS["scbench_substring"]("The value is abc-123.", ["abc-123"]) == 1.0
    assert SCORERS["scbench_substring"]("The value is abc-123.", ["ABC-123"]) == 0.0  # case-sensitive
    assert SCORERS["scbench_upper_substring"]("  alice went home ", ["Alice"]) == 1.0
    assert SCORERS["scbench_upper_substring"]("alice", ["Bob", "ALI"]) == 1.0
    assert SCORERS["scbench_upper_substring"]("alice", ["Bob"]) == 0.0
    # 2 of 3 golds, rounded to 2 decimals as in the reference.
    assert SCORERS["scbench_string_match_all"]("X1 and x2", ["x1", "X2", "Y3"]) == 0.67


def test_char_f1() -> None:
    # "北京大学" vs "北京": 2 common chars, P = 2/4, R = 2/2, F1 = 2/3 (the 。 is punctuation).
    assert SCORERS["scbench_qa_f1_chars"]("北京大学。", ["北京"]) == pytest.approx(2 / 3)
    # Normalised "beijing北京" (9 chars) vs "北京": P = 2/9, R = 1, F1 = 4/11; max over golds.
    assert SCORERS["scbench_qa_f1_chars"]("Beijing, 北京!", ["上海", "北京"]) == pytest.approx(4 / 11)
    assert SCORERS["scbench_qa_f1_chars"]("", ["北京"]) == 0.0


@pytest.mark.parametrize(
    ("prediction", "expected"),
    [
        ("B. blue whale", 1.0),  # first character is a letter: it decides
        ("C", 0.0),
        ("AB", 0.0),
        ("blue whale", 1.0),  # the whole prediction is a gold
        ("I think the answer is: B", 1.0),  # text after "answer is:" starts with a gold
        ("The answer is (B)", 0.0),  # after "answer is" comes "(B)", which starts with no gold
        ("Option B seems right", 1.0),  # first word that is a substring of "ABCD"
        ("", 0.0),
    ],
)
def test_choice_extraction(prediction: str, expected: float) -> None:
    assert SCORERS["scbench_choice"](prediction, ["blue whale", "B"]) == expected


def test_number_rules() -> None:
    assert SCORERS["scbench_math_find"]("The answer is 42.7 today", ["42"]) == 1.0  # int(float("42.7"))
    assert SCORERS["scbench_math_find"]("-42", ["-42"]) == 0.0  # unsigned regex, as in the reference
    assert SCORERS["scbench_math_find"]("3.50 maybe", ["3.5"]) == 1.0
    assert SCORERS["scbench_math_find"]("none", ["3"]) == 0.0
    assert SCORERS["scbench_first_int"]("The passkey is 00123. Then 5.", ["00123"]) == 1.0
    assert SCORERS["scbench_first_int"]("The passkey is 00123.", ["123"]) == 0.0  # string comparison


def test_rouge_lsum() -> None:
    # LCS 3 of 3 predicted and 6 reference tokens: P = 1, R = 1/2, F = 2/3.
    assert SCORERS["scbench_rouge_lsum"]("the cat sat", ["the cat sat on the mat"]) == pytest.approx(2 / 3)
    # Summary-level LCS over newline-split sentences: reference "a b c" / "d e" against "a b" / "d x e"
    # unions to 2 + 2 hits; 5 tokens on each side, so P = R = F = 4/5 (plain ROUGE-L would give 3/5).
    assert SCORERS["scbench_rouge_lsum"]("a b\nd x e", ["a b c\nd e"]) == pytest.approx(0.8)


def test_repoqa_extraction_and_threshold() -> None:
    answers = [GOLD_FN, GOLD_FN, OTHER_FN]
    # tree-sitter cuts the function out of the block, so the import line does not lower the similarity.
    block = f"```python\nimport os\n\n{GOLD_FN}\n```"
    assert sm.extract_function(block, "python") == GOLD_FN
    assert SCORERS["scbench_repoqa_python"](block, answers) == 1.0
    # Without a fenced block the whole answer is compared: the prose drags BLEU under 0.8.
    prose = f"The function you want is below, copied from utils:\n{GOLD_FN}\nIt adds one to x and returns it."
    assert sm.function_similarity(sm.extract_function(prose, "python"), GOLD_FN) < sm.REPOQA_THRESHOLD
    assert SCORERS["scbench_repoqa_python"](prose, answers) == 0.0
    # A block with no function definition falls back to the block itself.
    assert sm.extract_function("```\nx = 1\n```", "python") == "x = 1\n"
    assert SCORERS["scbench_repoqa_python"]("", answers) == 0.0
