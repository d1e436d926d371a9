"""Bring-your-own data (`task=custom`) and sample export: lossless round trip, kvpress files, validation."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from kvbench.cli import export
from kvbench.core.errors import KVBenchError
from kvbench.engine.config import EngineConfig
from kvbench.engine.prompt import PromptBuilder
from kvbench.engine.sample import run_sample
from kvbench.methods import build_method
from kvbench.results.store import to_jsonable
from kvbench.tasks import generic_metrics
from kvbench.tasks.base import Sample, Turn, whitespace_meter
from kvbench.tasks.custom import Custom, write_samples
from kvbench.tasks.ruler import Ruler
from kvbench.tasks.scoring import SCORERS, score
from kvbench.tasks.twostage_retr import TwoStageRetr


def comparable(record: dict) -> dict:
    """A record without what differs between two runs of one sample: wall times and prefill-snapshot reuse."""

    def keep(key: str) -> bool:
        return not key.endswith(("_s", "_ms_per_token")) and key != "prefill_reused"

    record = to_jsonable(record)
    return {**{k: v for k, v in record.items() if keep(k)},
            "turns": [{k: v for k, v in turn.items() if keep(k)} for turn in record["turns"]]}


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_generic_metric_names():
    assert SCORERS["qa_f1"] is SCORERS["longbench_qa_f1"]
    assert SCORERS["rouge_l"] is SCORERS["longbench_rouge"]
    assert SCORERS["code_sim"] is SCORERS["longbench_code_sim"]
    assert all(name in SCORERS for name in generic_metrics.GENERIC_METRICS)
    assert score("exact_match", "The Eiffel Tower.", ["Louvre", "eiffel  tower"]) == 1.0
    assert score("exact_match", "42 metres", ["42"]) == 0.0
    assert score("qa_f1", "42 metres", ["42"]) == pytest.approx(2 / 3)


@pytest.mark.parametrize("task,overrides", [
    (lambda: Ruler("ruler_niah_single_1", 1024, 2, "niah_single_1"), ["task=ruler_niah_single_1", "task.seq_len=1024"]),
    # A short generation limit keeps the record comparison fast.
    (lambda: TwoStageRetr(num_samples=2, max_new_tokens=16), ["task=twostage_retr", "task.max_new_tokens=16"]),
])
def test_export_then_custom_reproduces_records(tiny_llama, tmp_path, capsys, task, overrides):
    out = tmp_path / "samples.parquet"
    assert export.main(["model=tiny_llama", *overrides, "task.num_samples=2", f"out={out}"]) == 0
    assert capsys.readouterr().out.strip() == f"wrote 2 samples to {out}"
    meter = PromptBuilder(tiny_llama.tokenizer).measure
    original = task().samples(meter, seed=42)
    reloaded = Custom(path=str(out), max_positions=tiny_llama.max_positions).samples(meter, seed=0)
    assert reloaded == original
    if original[0].turns[0].max_new_tokens > 16:
        return  # equal samples give equal records; running them is checked once, on the fast task
    method = build_method("snapkv", window=8)
    for before, after in zip(original, reloaded):
        a = run_sample(tiny_llama, method, 64, before, EngineConfig())
        b = run_sample(tiny_llama, method, 64, after, EngineConfig())
        assert comparable(a) == comparable(b)


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_every_format_round_trips_every_field(tmp_path, suffix):
    classes = {"all_classes": ["Location", "Person", "Number"]}
    samples = [
        Sample("s/1", "mixed_a", "Context one {braces}\n\ue000 \u2028 \x85 \x0c", [
            Turn("Q1?", ["a", "b"], 7, "qa_f1", "Answer:"),
            Turn("Q2?", ["Person"], 3, "longbench_classification_first_line", metric_args=classes),
        ], chat_template=False, stop=["\n", "END"], truncation="middle",
            meta={"mode": "multi_request", "golden_answers": ["a", "c"], "nested": {"x": [1, 2.5, None]}}),
        Sample("s/2", "mixed_b", "Context two", [Turn("Q?", ["Person"], 5, "longbench_classification_first_line",
                                                      metric_args=classes)]),
        Sample("s/3", "mixed_b", "Context three", [Turn("Q?", ["x"], 5, "exact_match")], meta={"k": 1}),
    ]
    path = tmp_path / f"data{suffix}"
    assert write_samples(samples, path) == 3
    assert Custom(path=str(path)).samples(whitespace_meter, seed=0) == samples


def test_kvpress_parquet_runs_and_scores(tiny_llama, tmp_path):
    # kvpress's layout as its datasets come out of `load_dataset(...).to_pandas()`: `answer` (a list for RULER),
    # no id, no metric; one extra column (`length`) that kvbench ignores.
    frame = pd.DataFrame({
        "context": ["The passkey is 73512. Remember it. " * 4, "Paris is the capital of France."],
        "question": ["\nWhat is the passkey?", "\nWhat is the capital of France?"],
        "answer_prefix": [" Answer:", " Answer:"],
        "answer": [["73512"], ["Paris", "paris"]],
        "task": ["passkey", "capital"],
        "max_new_tokens": [6, 4],
        "length": [150, 30],
    })
    path = tmp_path / "kvpress.parquet"
    frame.to_parquet(path)
    samples = Custom(path=str(path), metric="string_match_part").samples(whitespace_meter, seed=0)
    assert [(s.id, s.task, s.turns[0].answers, s.turns[0].max_new_tokens) for s in samples] == [
        ("0", "passkey", ["73512"], 6), ("1", "capital", ["Paris", "paris"], 4)]
    first = samples[0].turns[0]
    assert (first.question, first.answer_prefix, first.metric) == ("\nWhat is the passkey?", " Answer:", "string_match_part")
    for sample in samples:
        record = run_sample(tiny_llama, build_method("snapkv", window=8), 64, sample, EngineConfig())
        turn = record["turns"][0]
        assert turn["metric"] == "string_match_part" and turn["answers"] == sample.turns[0].answers
        assert record["score"] == turn["score"] == score("string_match_part", turn["prediction"], turn["answers"])
    # The scoring path itself, on predictions whose scores are known.
    assert score(first.metric, " The passkey is 73512.", first.answers) == 1.0
    assert score(first.metric, " 7351", first.answers) == 0.0


def test_row_values_win_over_task_defaults(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"context": "c", "question": "q", "answer": "Paris"},
        {"context": "c", "question": "q", "answers": ["x"], "metric": "exact_match", "max_new_tokens": 9, "id": 12},
        {"context": "c", "turns": [{"question": "q1", "answer": "a1"},
                                   {"question": "q2", "answers": ["a2"], "metric": "qa_f1", "max_new_tokens": 2}]},
    ])
    rows = Custom(path=str(path), metric="string_match_all", max_new_tokens=32).samples(whitespace_meter, seed=0)
    assert [r.id for r in rows] == ["0", "12", "2"]
    assert [(t.metric, t.max_new_tokens, t.answers) for r in rows for t in r.turns] == [
        ("string_match_all", 32, ["Paris"]), ("exact_match", 9, ["x"]),
        ("string_match_all", 32, ["a1"]), ("qa_f1", 2, ["a2"])]
    assert Custom(path=str(path), metric="qa_f1", num_samples=1).samples(whitespace_meter, seed=0)[0].id == "0"


GOOD = {"context": "Some context.", "question": "Q?", "answers": ["A"], "metric": "qa_f1"}


@pytest.mark.parametrize("bad,column,problem", [
    ({"question": "Q?", "answers": ["A"]}, "context", "is missing"),
    ({"context": "  \n", "question": "Q?", "answers": ["A"]}, "context", "is empty"),
    ({"context": 5, "question": "Q?", "answers": ["A"]}, "context", "must be a string"),
    ({"context": "c", "answers": ["A"]}, "question", "is missing"),
    ({"context": "c", "question": "Q?"}, "answers", "is missing"),
    ({"context": "c", "question": "Q?", "answers": 42}, "answers", "must be a string or a list of strings, got int 42"),
    ({"context": "c", "question": "Q?", "answers": []}, "answers", "is an empty list"),
    ({"context": "c", "question": "Q?", "answer": ""}, "answer", "holds an empty string"),
    ({"context": "c", "question": "Q?", "answers": ["A"], "answer": "A"}, "answers", "and column 'answer' are both given"),
    ({**GOOD, "max_new_tokens": "64"}, "max_new_tokens", "must be a positive integer, got str '64'"),
    ({**GOOD, "max_new_tokens": 0}, "max_new_tokens", "must be a positive integer"),
    ({**GOOD, "metric": "f1"}, "metric", "names unknown metric 'f1'; generic metrics: string_match_all"),
    ({**GOOD, "chat_template": "yes"}, "chat_template", "must be true or false"),
    ({**GOOD, "truncation": "left"}, "truncation", "must be one of"),
    ({**GOOD, "meta": [1]}, "meta", "must be an object"),
    ({**GOOD, "metric_args": {"all_classes": ["a"]}}, "metric_args", "do not fit metric 'qa_f1'"),
    ({**GOOD, "metric": "longbench_classification_first_line"}, "metric_args",
     "do not fit metric 'longbench_classification_first_line': missing a required argument: 'all_classes'"),
    ({**GOOD, "id": 1.5}, "id", "must be a non-empty string or an integer"),
    ({**GOOD, "id": "0"}, "id", "repeats the id of row 0"),
    ({"context": "c", "turns": [{"question": "q", "answers": "a"}, {"question": "q2"}]}, "turns[1].answers", "is missing"),
    ({"context": "c", "turns": [{"question": "q", "answers": "a", "anwser": "b"}]}, "turns[0]", "has unknown keys"),
    ({"context": "c", "question": "other", "turns": [{"question": "q", "answers": "a"}]}, "question", "differs"),
])
def test_invalid_row_names_row_and_column(tmp_path, bad, column, problem):
    # The bad row is row 1 of 3, and only the first row is selected: every row is still validated.
    path = write_jsonl(tmp_path / "bad.jsonl", [GOOD, bad, GOOD | {"id": "x"}])
    with pytest.raises(KVBenchError) as err:
        Custom(path=str(path), metric="qa_f1", num_samples=1).samples(whitespace_meter, seed=0)
    message = str(err.value)
    assert message.startswith(f"custom data {path} row 1 (line 2")
    assert f"column {column!r} {problem}" in message


def test_row_too_long_for_the_model(tiny_llama, tmp_path, capsys):
    meter = PromptBuilder(tiny_llama.tokenizer).measure
    path = write_jsonl(tmp_path / "long.jsonl", [GOOD, {**GOOD, "id": "big", "context": "x" * 9000}])
    with pytest.raises(KVBenchError, match=r"row 1 \(line 2, id 'big'\): column 'context' is too long: \d+ prompt "
                                           r"tokens \+ 64 new tokens exceed the model's limit of 8192 positions"):
        Custom(path=str(path), max_positions=tiny_llama.max_positions).samples(meter, seed=0)
    with pytest.raises(KVBenchError, match=r"row 0 \(line 1, id '0'\): column 'context' is too long: .* task.seq_len=8;"):
        Custom(path=str(path), seq_len=8, num_samples=1).samples(meter, seed=0)
    # The engine's per-sample cap on the prompt (SCBench exports carry it) is honoured too.
    capped = write_jsonl(tmp_path / "capped.jsonl", [{**GOOD, "meta": {"prompt_token_limit": 5}}])
    with pytest.raises(KVBenchError, match=r"row 0 .*: column 'context' is too long: \d+ prompt tokens exceed meta's "
                                           r"prompt_token_limit=5"):
        Custom(path=str(capped)).samples(meter, seed=0)
    # Middle truncation is the engine's answer to a long row, so such rows pass.
    assert len(Custom(path=str(path), truncation="middle", max_positions=8192).samples(meter, seed=0)) == 2
    # The exporter, like the runner, gives the task the model's limit.
    out = tmp_path / "never.jsonl"
    assert export.main(["model=tiny_llama", "task=custom", f"task.path={path}", f"out={out}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvbench: error: custom data") and "column 'context' is too long" in err
    assert not out.exists()


@pytest.mark.parametrize("name,content,message", [
    ("missing.jsonl", None, "no such file"),
    ("data.csv", "a,b\n", "unsupported file type '.csv'"),
    ("empty.jsonl", "\n", "the file holds no rows"),
    ("torn.jsonl", json.dumps(GOOD) + '\n{"context": "c", "quest', r"row 1 \(line 2\): not valid JSON"),
    ("broken.json", '[{"context": "c"}', "not valid JSON"),
    ("scalar.json", '{"context": "c"}', "must hold a list of row objects"),
    ("corrupt.parquet", "PAR1 this is not parquet", "not a readable Parquet file"),
    ("list.jsonl", "[1, 2]\n", r"row 0 \(line 1\): a row must be an object"),
])
def test_unreadable_file(tmp_path, name, content, message):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(KVBenchError, match=message):
        Custom(path=str(path), metric="qa_f1").samples(whitespace_meter, seed=0)


def test_json_lines_under_a_json_name(tmp_path):
    # `datasets.Dataset.to_json` writes JSON Lines even to a .json file.
    path = write_jsonl(tmp_path / "hf.json", [GOOD, GOOD | {"id": "b"}])
    assert [s.id for s in Custom(path=str(path)).samples(whitespace_meter, seed=0)] == ["0", "b"]


def test_bad_settings(tmp_path):
    with pytest.raises(KVBenchError, match="needs task.path"):
        Custom().samples(whitespace_meter, seed=0)
    with pytest.raises(KVBenchError, match="task.metric names unknown metric 'f1'"):
        Custom(path="x.jsonl", metric="f1").samples(whitespace_meter, seed=0)
    with pytest.raises(KVBenchError, match="task.max_new_tokens must be a positive integer"):
        Custom(path="x.jsonl", max_new_tokens=0).samples(whitespace_meter, seed=0)
    path = write_jsonl(tmp_path / "d.jsonl", [{"context": "c", "question": "q", "answers": "a"}])
    with pytest.raises(KVBenchError, match="row 0 .*: column 'metric' is missing and task.metric is not set"):
        Custom(path=str(path)).samples(whitespace_meter, seed=0)


def run(module: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, capture_output=True, text=True, timeout=300,
                          check=False)


def test_cli_refuses_invalid_file_before_writing_records(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [GOOD, {**GOOD, "max_new_tokens": "many"}])
    result = run("kvbench", "model=tiny_llama", "task=custom", f"task.path={path}", f"results_dir={tmp_path / 'out'}",
                 cwd=tmp_path)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines == [(f"kvbench: error: custom data {path} row 1 (line 2, id '1'): column 'max_new_tokens' must be a "
                      "positive integer, got str 'many'")]
    assert not list(tmp_path.rglob("records.jsonl"))


def test_export_cli(tiny_llama, tmp_path):
    result = run("kvbench", "export", "model=tiny_llama", "task=twostage_retr", "task.num_samples=2", "out=x.jsonl",
                 cwd=tmp_path)  # `kvbench export ...`, as `python -m kvbench.export ...` (the help below)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "wrote 2 samples to x.jsonl"
    rows = [json.loads(line) for line in (tmp_path / "x.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == ["twostage_retr-4096-0", "twostage_retr-4096-1"]
    assert {"context", "question", "answer_prefix", "answers", "max_new_tokens", "metric"} <= set(rows[0])
    meter = PromptBuilder(tiny_llama.tokenizer).measure
    expected = TwoStageRetr(num_samples=2).samples(meter, seed=42)
    assert Custom(path=str(tmp_path / "x.jsonl")).samples(meter, seed=0) == expected
    assert not [p.name for p in tmp_path.iterdir() if p.name != "x.jsonl"]  # no temporary file left behind
    help_text = run("kvbench.export", "--help", cwd=tmp_path)
    assert help_text.returncode == 0 and help_text.stdout.startswith("usage: kvbench export")


@pytest.mark.parametrize("args,message", [
    (["task.num_samples=abc"], "task.num_samples must be a positive integer"),  # was Hydra's wrapped ValueError
    (["seed=x"], "seed must be an integer from 0 to 2**32 - 1, got 'x'"),  # was a numpy traceback
    (["task.chat_template=maybe"], "task twostage_retr: chat_template must be true or false"),  # was read as true
    (["budgt=3"], "unknown setting 'budgt' (did you mean budget?)"),
    (["out=/proc/x.jsonl"], "out=/proc/x.jsonl: cannot write in /proc"),  # was a traceback after the samples
])
def test_export_refuses_bad_input_in_one_line_before_the_model_loads(tmp_path, capsys, monkeypatch, args, message):
    from kvbench.cli import export as export_cli

    monkeypatch.setattr(export_cli, "cached_model", lambda cfg: pytest.fail("the model loaded"))
    out = [a for a in args if a.startswith("out=")] or [f"out={tmp_path / 'x.jsonl'}"]
    argv = ["model=tiny_llama", "task=twostage_retr", *[a for a in args if not a.startswith("out=")], *out]
    assert export_cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvbench: error: ") and message in err and len(err.strip().splitlines()) == 1
    assert not list(tmp_path.iterdir())


def test_export_makes_the_folder_of_its_file(tmp_path):
    result = run("kvbench", "export", "model=tiny_llama", "task=twostage_retr", "task.num_samples=1",
                 "out=data/x.jsonl", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert len((tmp_path / "data" / "x.jsonl").read_text().splitlines()) == 1


def test_cli_refuses_row_too_long_for_the_model(tmp_path):
    path = write_jsonl(tmp_path / "long.jsonl", [GOOD, {**GOOD, "id": "big", "context": "x" * 9000}])
    result = run("kvbench", "model=tiny_llama", "task=custom", f"task.path={path}", f"results_dir={tmp_path / 'out'}",
                 cwd=tmp_path)
    assert result.returncode == 2 and "row 1 (line 2, id 'big'): column 'context' is too long" in result.stderr
    assert not list(tmp_path.rglob("records.jsonl"))


def test_edited_data_file_is_a_new_point_not_a_resume(tmp_path):
    from omegaconf import OmegaConf

    from kvbench.run.identity import point_identity

    path = write_jsonl(tmp_path / "data.jsonl", [GOOD])
    cfg = OmegaConf.create({"model": {"dtype": "float32", "device": "cpu"}, "task": {"path": str(path)}, "method": {"name": "snapkv"}, "budget": 1,
                            "compress_question": True, "engine": {}, "seed": 0})
    before = point_identity(cfg)
    write_jsonl(path, [{**GOOD, "context": "Other context."}])
    assert point_identity(cfg) != before
