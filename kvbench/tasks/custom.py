"""Bring-your-own data: `task=custom task.path=FILE` runs the rows of a JSONL, JSON or Parquet file.

One row is one sample. The core columns are the layout of kvpress's evaluation datasets, so a kvpress
dataset file runs unchanged; the extension columns make a file written by `python -m kvbench.export`
reproduce kvbench's own samples exactly (other harnesses can ignore them). docs/custom-data.md has examples.

| column           | type                        | required | meaning                                              |
| ---------------- | --------------------------- | -------- | ---------------------------------------------------- |
| `context`        | string, not blank           | yes      | the long document (the part that gets compressed)    |
| `question`       | string (may be empty)       | yes [1]  | appended after the context                           |
| `answers`        | string or list of strings   | yes [1]  | gold answer(s); kvpress's name `answer` is accepted  |
| `answer_prefix`  | string                      | no       | lead-in of the assistant's reply; default ""         |
| `max_new_tokens` | positive integer            | no       | generation limit; default `task.max_new_tokens`      |
| `metric`         | string, a registered metric | no       | scorer; default `task.metric` (one of them needed)   |
| `metric_args`    | object (or its JSON string) | no       | scorer keyword arguments; default {}                 |
| `id`             | string or integer, unique   | no       | sample id; default the row index (0-based)           |
| `turns`          | list of turn objects        | no       | a multi-turn session, see below                      |
| `task`           | string                      | no       | (sub)task name in records; default `task.name`       |
| `chat_template`  | boolean                     | no       | use the model's chat template; default `task.*`      |
| `stop`           | string or list of strings   | no       | extra stop strings; default none                     |
| `truncation`     | "error" or "middle"         | no       | too long: refuse / keep both ends; default `task.*`  |
| `meta`           | object (or its JSON string) | no       | facts copied into every record; default {}           |

[1] Not needed when `turns` is given. `turns` lists every turn of the session, first one included: objects
with `question` and `answers` (or `answer`) and optionally `answer_prefix`, `max_new_tokens`, `metric` and
`metric_args`, which default to the row's columns. Later turns are asked on the same cache with the gold
answers of earlier turns as history. A row with `turns` may also carry `question`/`answers`; they must then
repeat the first turn (the exporter writes them so that single-turn harnesses can still run the first one).

Choices:
- A file's values win; `task.*` settings only fill what a row leaves out, so an exported file runs exactly as
  it was exported whatever the task config says.
- Every row is validated before any sample is returned, so an invalid file fails before the first record is
  written. Errors name the file, the row (its 0-based index, the JSONL line, the id) and the column.
- The length check needs the model: rows with `truncation: error` must pass the engine's limits
  (`kvbench.engine.fit_to_model`: the model's limit on prompt + generated tokens, which the runner puts in
  `max_positions`, and `meta["prompt_token_limit"]`) and `seq_len` when set. The engine would otherwise
  refuse such a row mid-run, after earlier records were written. Only the rows selected by `num_samples`
  are measured, since tokenizing long contexts is the expensive part.
- JSON and JSON Lines are read with the standard library, not pandas, so that types are exactly the file's
  (pandas would turn the id "007" into 7 and a missing value into NaN). A `.json` file holds a list of rows
  or, as `datasets.Dataset.to_json` writes it, JSON Lines. Parquet goes through pyarrow; there `meta` and
  `metric_args` are JSON strings, because Parquet would merge the keys of all rows' objects into one struct.
- Unknown columns are ignored with a warning (a typo such as `answer_prefx` would otherwise pass unseen).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import os
import reprlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kvbench.core.errors import KVBenchError
from kvbench.tasks import generic_metrics
from kvbench.tasks.base import PromptMeter, Sample, Task, Turn
from kvbench.tasks.scoring import SCORERS, get_scorer

log = logging.getLogger(__name__)

FORMATS = (".jsonl", ".json", ".parquet")
TRUNCATIONS = ("error", "middle")
TURN_KEYS = ("question", "answers", "answer", "answer_prefix", "max_new_tokens", "metric", "metric_args")
COLUMNS = ("context", "question", "answers", "answer", "answer_prefix", "max_new_tokens", "metric", "metric_args",
           "id", "turns", "task", "chat_template", "stop", "truncation", "meta")


@dataclasses.dataclass
class _Row:
    """A raw row and where it came from, for error messages."""

    path: Path
    index: int
    data: Any
    line: int | None = None
    id: str | None = None

    def where(self) -> str:
        details = [f"line {self.line}"] if self.line is not None else []
        if self.id is not None:
            details.append(f"id {self.id!r}")
        return f"custom data {self.path} row {self.index}" + (f" ({', '.join(details)})" if details else "")

    def error(self, column: str, problem: str) -> KVBenchError:
        return KVBenchError(f"{self.where()}: column {column!r} {problem}")


def _type_name(value: Any) -> str:
    return f"{type(value).__name__} {reprlib.repr(value)}"


# ---------------------------------------------------------------------------------------------------------------
# Reading files
# ---------------------------------------------------------------------------------------------------------------


def _json_lines(path: Path, text: str) -> list[_Row]:
    rows: list[_Row] = []
    # Split on "\n" only: str.splitlines also breaks at U+2028, U+0085, ..., which JSON strings hold unescaped.
    for line_no, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except json.JSONDecodeError as err:
            raise KVBenchError(f"custom data {path} row {len(rows)} (line {line_no}): not valid JSON ({err.msg} "
                               f"at column {err.colno})") from None
        rows.append(_Row(path, len(rows), data, line=line_no))
    return rows


def read_rows(path: Path) -> list[_Row]:
    """The file's rows in order, raw. Raises KVBenchError for a missing, unreadable or empty file."""
    if path.suffix not in FORMATS:
        raise KVBenchError(f"custom data {path}: unsupported file type {path.suffix!r}; use {', '.join(FORMATS)}")
    if not path.is_file():
        raise KVBenchError(f"custom data {path}: no such file")
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except (pa.ArrowException, OSError) as err:
            raise KVBenchError(f"custom data {path}: not a readable Parquet file ({err})") from None
        rows = [_Row(path, i, data) for i, data in enumerate(table.to_pylist())]
    else:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise KVBenchError(f"custom data {path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
        if path.suffix == ".jsonl":
            rows = _json_lines(path, text)
        else:
            try:
                document = json.loads(text)
            except json.JSONDecodeError as err:
                if err.msg != "Extra data":
                    raise KVBenchError(f"custom data {path}: not valid JSON ({err.msg} at line {err.lineno}, "
                                       f"column {err.colno})") from None
                document = None  # several top-level values: JSON Lines under a .json name
            if document is None:
                rows = _json_lines(path, text)
            elif isinstance(document, list):
                rows = [_Row(path, i, data) for i, data in enumerate(document)]
            else:
                raise KVBenchError(f"custom data {path}: a .json file must hold a list of row objects or JSON "
                                   f"Lines, not a {type(document).__name__}")
    if not rows:
        raise KVBenchError(f"custom data {path}: the file holds no rows")
    return rows


# ---------------------------------------------------------------------------------------------------------------
# Validating one row
# ---------------------------------------------------------------------------------------------------------------


def _string(row: _Row, column: str, value: Any, *, blank_ok: bool = True) -> str:
    if not isinstance(value, str):
        raise row.error(column, f"must be a string, got {_type_name(value)}")
    if not blank_ok and not value.strip():
        raise row.error(column, "is empty")
    return value


def _strings(row: _Row, column: str, value: Any, *, empty_list_ok: bool = False) -> list[str]:
    """A string or a list of non-empty strings, as a list."""
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list):
        raise row.error(column, f"must be a string or a list of strings, got {_type_name(value)}")
    if not values and not empty_list_ok:
        raise row.error(column, "is an empty list")
    for i, item in enumerate(values):
        if not isinstance(item, str):
            raise row.error(column, f"must be a string or a list of strings, got {_type_name(item)} at position {i}")
        if not item:  # "" is a substring of every prediction: it would score 1 whatever the model says
            raise row.error(column, f"holds an empty string{'' if isinstance(value, str) else f' at position {i}'}")
    return list(values)


def _positive_int(row: _Row, column: str, value: Any) -> int:
    # Integral floats are accepted: pandas stores an integer column that has a missing value as float64.
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise row.error(column, f"must be a positive integer, got {_type_name(value)}")
    if value < 1:
        raise row.error(column, f"must be a positive integer, got {value}")
    return value


def check_metric(name: str) -> str | None:
    """None if `name` is a registered scorer, else the reason (listing the known names)."""
    try:
        get_scorer(name)
    except KeyError:
        return (f"names unknown metric {name!r}; generic metrics: {', '.join(generic_metrics.GENERIC_METRICS)}; "
                f"every registered metric: {', '.join(sorted(SCORERS))}")
    return None


def _object(row: _Row, column: str, value: Any) -> dict[str, Any]:
    """An object, or its JSON text (how Parquet files carry free-form objects); None gives {}."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise row.error(column, f"is a string but not JSON ({err.msg})") from None
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise row.error(column, f"must be an object, got {_type_name(value)}")
    return value


@dataclasses.dataclass
class _Defaults:
    name: str
    metric: str | None
    max_new_tokens: int
    chat_template: bool
    truncation: str


def _pick_answers(row: _Row, data: dict[str, Any], prefix: str) -> list[str] | None:
    answers, answer = data.get("answers"), data.get("answer")
    if answers is not None and answer is not None:
        raise row.error(f"{prefix}answers", f"and column {prefix + 'answer'!r} are both given; keep one")
    if answers is not None:
        return _strings(row, f"{prefix}answers", answers)
    if answer is not None:
        return _strings(row, f"{prefix}answer", answer)
    return None


def _turn_settings(row: _Row, data: dict[str, Any], prefix: str, base: dict[str, Any]) -> dict[str, Any]:
    """answer_prefix, max_new_tokens, metric and metric_args of `data`, each falling back to `base`'s."""
    out = dict(base)
    if data.get("answer_prefix") is not None:
        out["answer_prefix"] = _string(row, f"{prefix}answer_prefix", data["answer_prefix"])
    if data.get("max_new_tokens") is not None:
        out["max_new_tokens"] = _positive_int(row, f"{prefix}max_new_tokens", data["max_new_tokens"])
    if data.get("metric") is not None:
        problem = check_metric(_string(row, f"{prefix}metric", data["metric"]))
        if problem:
            raise row.error(f"{prefix}metric", problem)
        out["metric"] = data["metric"]
    if data.get("metric_args") is not None:
        out["metric_args"] = _object(row, f"{prefix}metric_args", data["metric_args"])
    return out


def _turn(row: _Row, data: Any, prefix: str, base: dict[str, Any]) -> Turn:
    """One turn from `data` (the row itself or a `turns` entry); `base` holds the row-level settings."""
    if not isinstance(data, dict):
        raise row.error(prefix.rstrip("."), f"must be an object, got {_type_name(data)}")
    if data.get("question") is None:
        raise row.error(f"{prefix}question", "is missing")
    question = _string(row, f"{prefix}question", data["question"])
    answers = _pick_answers(row, data, prefix)
    if answers is None:
        raise row.error(f"{prefix}answers", "is missing (kvpress's name 'answer' is accepted too)")
    settings = _turn_settings(row, data, prefix, base)
    if settings["metric"] is None:
        raise row.error(f"{prefix}metric", "is missing and task.metric is not set; add the column or pass "
                                          f"task.metric= (one of {', '.join(generic_metrics.GENERIC_METRICS)})")
    # The engine calls scorer(prediction, answers, **metric_args): arguments that do not fit would fail
    # mid-run, after earlier records were written.
    try:
        inspect.signature(get_scorer(settings["metric"])).bind("", answers, **settings["metric_args"])
    except TypeError as err:
        raise row.error(f"{prefix}metric_args", f"do not fit metric {settings['metric']!r}: {err}") from None
    return Turn(question=question, answers=answers, max_new_tokens=settings["max_new_tokens"],
                metric=settings["metric"], answer_prefix=settings["answer_prefix"], metric_args=settings["metric_args"])


def parse_row(row: _Row, defaults: _Defaults) -> Sample:
    """Validate one raw row and build its sample; every problem raises KVBenchError naming row and column."""
    data = row.data
    if not isinstance(data, dict):
        raise KVBenchError(f"{row.where()}: a row must be an object with columns, got {_type_name(data)}")
    raw_id = data.get("id")
    if raw_id is None:
        row.id = str(row.index)
    elif isinstance(raw_id, str) and raw_id:
        row.id = raw_id
    elif isinstance(raw_id, int) and not isinstance(raw_id, bool):
        row.id = str(raw_id)
    else:
        raise row.error("id", f"must be a non-empty string or an integer, got {_type_name(raw_id)}")
    if data.get("context") is None:
        raise row.error("context", "is missing")
    context = _string(row, "context", data["context"], blank_ok=False)
    meta = _object(row, "meta", data.get("meta"))
    task = defaults.name if data.get("task") is None else _string(row, "task", data["task"], blank_ok=False)
    chat_template = data.get("chat_template")
    if chat_template is None:
        chat_template = defaults.chat_template
    elif not isinstance(chat_template, bool):
        raise row.error("chat_template", f"must be true or false, got {_type_name(chat_template)}")
    stop = [] if data.get("stop") is None else _strings(row, "stop", data["stop"], empty_list_ok=True)
    truncation = defaults.truncation if data.get("truncation") is None else data["truncation"]
    if truncation not in TRUNCATIONS:
        raise row.error("truncation", f"must be one of {', '.join(map(repr, TRUNCATIONS))}, "
                                      f"got {_type_name(truncation)}")

    task_settings = {"answer_prefix": "", "max_new_tokens": defaults.max_new_tokens, "metric": defaults.metric,
                     "metric_args": {}}
    raw_turns = data.get("turns")
    if raw_turns is None:
        turns = [_turn(row, data, "", task_settings)]
    else:
        if not isinstance(raw_turns, list) or not raw_turns:
            raise row.error("turns", f"must be a non-empty list of turn objects, got {_type_name(raw_turns)}")
        # Unknown keys are an error here but only a warning as columns: other datasets carry extra columns,
        # while `turns` is kvbench's own structure, where an unknown key can only be a typo.
        for i, t in enumerate(raw_turns):
            unknown = sorted(set(t) - set(TURN_KEYS)) if isinstance(t, dict) else []
            if unknown:
                raise row.error(f"turns[{i}]", f"has unknown keys {unknown}; a turn takes {', '.join(TURN_KEYS)}")
        base = _turn_settings(row, data, "", task_settings)
        turns = [_turn(row, t, f"turns[{i}].", base) for i, t in enumerate(raw_turns)]
        # Top-level question/answers beside `turns` are the first turn for single-turn readers; they must agree.
        if data.get("question") is not None and data["question"] != turns[0].question:
            raise row.error("question", "differs from turns[0].question; with 'turns' it may only repeat the "
                                        "first turn")
        top_answers = _pick_answers(row, data, "")
        if top_answers is not None and top_answers != turns[0].answers:
            raise row.error("answers", "differ from turns[0].answers; with 'turns' they may only repeat the first turn")
    return Sample(id=row.id, task=task, context=context, turns=turns, chat_template=chat_template, stop=stop,
                  truncation=truncation, meta=meta)


# ---------------------------------------------------------------------------------------------------------------
# The task
# ---------------------------------------------------------------------------------------------------------------


class Custom(Task):
    """Samples read from a data file (the layout is in the module docstring and docs/custom-data.md).

    Args:
        name: run label; also `Sample.task` for rows without a `task` column.
        path: the .jsonl, .json or .parquet file (relative paths are relative to the working directory).
        metric: scorer for rows without a `metric` column (e.g. "qa_f1"); None requires the column.
        max_new_tokens: generation limit for rows without a `max_new_tokens` column.
        num_samples: run the first N rows (all rows are still validated); None runs every row.
        seq_len: when set, rows must fit in it (prompt with chat template + max_new_tokens of every turn).
        chat_template: default for rows without a `chat_template` column.
        truncation: default for rows without a `truncation` column ("error" or "middle").
        max_positions: the model's limit on prompt + generated tokens. The runner sets it once the model is
            loaded; None skips the model-limit check.
    """

    def __init__(self, name: str = "custom", path: str | None = None, metric: str | None = None,
                 max_new_tokens: int = 64, num_samples: int | None = None, seq_len: int | None = None,
                 chat_template: bool = True, truncation: str = "error", max_positions: int | None = None) -> None:
        # Only stored here: every check needs the file or the model's limit, so all of them run in `samples`.
        self.name = name
        self.path = path
        self.metric = metric
        self.max_new_tokens = max_new_tokens
        self.num_samples = num_samples
        self.seq_len = seq_len
        self.chat_template = chat_template
        self.truncation = truncation
        self.max_positions = max_positions

    def _check_settings(self) -> _Defaults:
        if not self.path:
            raise KVBenchError("task=custom needs task.path=FILE (.jsonl, .json or .parquet)")
        if self.metric is not None:
            problem = check_metric(str(self.metric))
            if problem:
                raise KVBenchError(f"task.metric {problem}")
        for key, optional in (("max_new_tokens", False), ("num_samples", True), ("seq_len", True)):
            value = getattr(self, key)
            if value is None and optional:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise KVBenchError(f"task.{key} must be a positive integer{' or null' if optional else ''}, "
                                   f"got {value!r}")
        if self.truncation not in TRUNCATIONS:
            raise KVBenchError(f"task.truncation must be one of {', '.join(TRUNCATIONS)}, got {self.truncation!r}")
        return _Defaults(self.name, self.metric, self.max_new_tokens, bool(self.chat_template), self.truncation)

    def samples(self, meter: PromptMeter, seed: int) -> list[Sample]:
        """The file's samples (the first `num_samples`), after validating every row. `seed` is unused."""
        defaults = self._check_settings()
        rows = read_rows(Path(self.path).expanduser())
        unknown = sorted({key for row in rows if isinstance(row.data, dict) for key in row.data} - set(COLUMNS))
        if unknown:
            log.warning("custom data %s: ignoring unknown columns %s (known: %s)", self.path, ", ".join(unknown),
                        ", ".join(COLUMNS))
        samples = [parse_row(row, defaults) for row in rows]
        first_row: dict[str, _Row] = {}
        for row in rows:
            if row.id in first_row:
                raise row.error("id", f"repeats the id of row {first_row[row.id].index}; ids must be unique "
                                      "(records and resuming are keyed by id)")
            first_row[row.id] = row
        selected = len(rows) if self.num_samples is None else self.num_samples
        for row, sample in zip(rows[:selected], samples[:selected]):
            self._check_length(row, sample, meter)
        return samples[:selected]

    def _check_length(self, row: _Row, sample: Sample, meter: PromptMeter) -> None:
        """Refuse a row the engine would refuse: the limits of `kvbench.engine.fit_to_model`, and seq_len."""
        if sample.truncation != "error":
            return
        first = sample.turns[0]
        new_tokens = sum(t.max_new_tokens for t in sample.turns)
        prompt = meter(sample.context, first.question, first.answer_prefix, sample.chat_template)
        total = f"{prompt} prompt tokens + {new_tokens} new tokens"
        problems = []
        if self.max_positions is not None and prompt + new_tokens > self.max_positions:
            problems.append(f"{total} exceed the model's limit of {self.max_positions} positions")
        if self.seq_len is not None and prompt + new_tokens > self.seq_len:
            problems.append(f"{total} exceed task.seq_len={self.seq_len}")
        if sample.meta.get("prompt_token_limit") and prompt > int(sample.meta["prompt_token_limit"]):
            cap = sample.meta["prompt_token_limit"]
            problems.append(f"{prompt} prompt tokens exceed meta's prompt_token_limit={cap}")
        if problems:
            raise row.error("context", f"is too long: {problems[0]}; shorten it, or set truncation to 'middle' (the "
                                       "column, or task.truncation=middle) to keep its two ends")


# ---------------------------------------------------------------------------------------------------------------
# Writing: the exporter's side of the same layout
# ---------------------------------------------------------------------------------------------------------------


def sample_to_row(sample: Sample) -> dict[str, Any]:
    """A sample as a row that `Custom` reads back into an equal sample.

    The core columns hold the first turn, so a single-turn harness runs the first question; `turns` is written
    only for multi-turn samples. `answers` is always a list.
    """
    first = sample.turns[0]
    row: dict[str, Any] = {
        "id": sample.id,
        "task": sample.task,
        "context": sample.context,
        "question": first.question,
        "answer_prefix": first.answer_prefix,
        "answers": list(first.answers),
        "max_new_tokens": first.max_new_tokens,
        "metric": first.metric,
        "chat_template": sample.chat_template,
        "stop": list(sample.stop),
        "metric_args": first.metric_args,
        "truncation": sample.truncation,
        "meta": sample.meta,
    }
    if len(sample.turns) > 1:
        row["turns"] = [dataclasses.asdict(t) for t in sample.turns]
    return row


def _as_json_objects(row: dict[str, Any]) -> dict[str, Any]:
    """The row for Parquet: free-form objects as JSON text, since Parquet would merge all rows' keys."""
    row = {**row, "meta": json.dumps(row["meta"], ensure_ascii=False),
           "metric_args": json.dumps(row["metric_args"], ensure_ascii=False)}
    if "turns" in row:
        row["turns"] = [{**t, "metric_args": json.dumps(t["metric_args"], ensure_ascii=False)} for t in row["turns"]]
    return row


def write_samples(samples: Iterable[Sample], path: Path) -> int:
    """Write samples as rows, in the format named by `path`'s suffix, atomically; returns the row count.

    The file appears complete or not at all: rows go to a temporary file in the same directory, renamed
    over `path` at the end.
    """
    if path.suffix not in FORMATS:
        raise KVBenchError(f"cannot write {path}: unsupported file type {path.suffix!r}; use {', '.join(FORMATS)}")
    rows = [sample_to_row(s) for s in samples]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        if path.suffix == ".parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            rows = [_as_json_objects(row) for row in rows]
            # By column, null where a row lacks the key (pa.Table.from_pylist would take the first row's keys).
            columns = list(dict.fromkeys(key for row in rows for key in row))
            pq.write_table(pa.table({key: [row.get(key) for row in rows] for key in columns}), tmp)
        else:
            with tmp.open("w", encoding="utf-8") as f:
                if path.suffix == ".jsonl":
                    f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
                else:
                    json.dump(rows, f, ensure_ascii=False)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return len(rows)
