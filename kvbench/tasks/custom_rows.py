"""Reading and validating the rows of a `task=custom` data file (the layout is in `kvbench.tasks.custom`'s
docstring and docs/custom-data.md)."""

from __future__ import annotations

import dataclasses
import inspect
import json
import reprlib
from pathlib import Path
from typing import Any

from kvbench.core.errors import KVBenchError
from kvbench.tasks import generic_metrics
from kvbench.tasks.base import Sample, Turn
from kvbench.tasks.scoring import SCORERS, get_scorer

FORMATS = (".jsonl", ".json", ".parquet")
TRUNCATIONS = ("error", "middle")
TURN_KEYS = ("question", "answers", "answer", "answer_prefix", "max_new_tokens", "metric", "metric_args")
COLUMNS = ("context", "question", "answers", "answer", "answer_prefix", "max_new_tokens", "metric", "metric_args",
           "id", "turns", "task", "chat_template", "stop", "truncation", "meta")


@dataclasses.dataclass
class Row:
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


def _json_lines(path: Path, text: str) -> list[Row]:
    rows: list[Row] = []
    # Split on "\n" only: str.splitlines also breaks at U+2028, U+0085, ..., which JSON strings hold unescaped.
    for line_no, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except json.JSONDecodeError as err:
            raise KVBenchError(f"custom data {path} row {len(rows)} (line {line_no}): not valid JSON ({err.msg} "
                               f"at column {err.colno})") from None
        rows.append(Row(path, len(rows), data, line=line_no))
    return rows


def check_file(path: Path) -> None:
    """Raise KVBenchError for a data file of an unsupported type or that is not there."""
    if path.suffix not in FORMATS:
        raise KVBenchError(f"custom data {path}: unsupported file type {path.suffix!r}; use {', '.join(FORMATS)}")
    if not path.is_file():
        raise KVBenchError(f"custom data {path}: no such file")


def read_rows(path: Path) -> list[Row]:
    """The file's rows in order, raw. Raises KVBenchError for a missing, unreadable or empty file."""
    check_file(path)
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except (pa.ArrowException, OSError) as err:
            raise KVBenchError(f"custom data {path}: not a readable Parquet file ({err})") from None
        rows = [Row(path, i, data) for i, data in enumerate(table.to_pylist())]
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
                rows = [Row(path, i, data) for i, data in enumerate(document)]
            else:
                raise KVBenchError(f"custom data {path}: a .json file must hold a list of row objects or JSON "
                                   f"Lines, not a {type(document).__name__}")
    if not rows:
        raise KVBenchError(f"custom data {path}: the file holds no rows")
    return rows


# ---------------------------------------------------------------------------------------------------------------
# Validating one row
# ---------------------------------------------------------------------------------------------------------------


def _string(row: Row, column: str, value: Any, *, blank_ok: bool = True) -> str:
    if not isinstance(value, str):
        raise row.error(column, f"must be a string, got {_type_name(value)}")
    if not blank_ok and not value.strip():
        raise row.error(column, "is empty")
    return value


def _strings(row: Row, column: str, value: Any, *, empty_list_ok: bool = False) -> list[str]:
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


def _positive_int(row: Row, column: str, value: Any) -> int:
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


def _object(row: Row, column: str, value: Any) -> dict[str, Any]:
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
class Defaults:
    name: str
    metric: str | None
    max_new_tokens: int
    chat_template: bool
    truncation: str


def _pick_answers(row: Row, data: dict[str, Any], prefix: str) -> list[str] | None:
    answers, answer = data.get("answers"), data.get("answer")
    if answers is not None and answer is not None:
        raise row.error(f"{prefix}answers", f"and column {prefix + 'answer'!r} are both given; keep one")
    if answers is not None:
        return _strings(row, f"{prefix}answers", answers)
    if answer is not None:
        return _strings(row, f"{prefix}answer", answer)
    return None


def _turn_settings(row: Row, data: dict[str, Any], prefix: str, base: dict[str, Any]) -> dict[str, Any]:
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


def _turn(row: Row, data: Any, prefix: str, base: dict[str, Any]) -> Turn:
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


def parse_row(row: Row, defaults: Defaults) -> Sample:
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
