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

Layout: reading and validating rows in `custom_rows`; the task and the exporter's writer here.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kvbench.core.errors import KVBenchError
from kvbench.tasks.base import PromptMeter, Sample, Task
from kvbench.tasks.custom_rows import (
    COLUMNS,
    FORMATS,
    TRUNCATIONS,
    Defaults,
    Row,
    check_file,
    check_metric,
    parse_row,
    read_rows,
)

__all__ = ["COLUMNS", "FORMATS", "Custom", "check_metric", "read_rows", "sample_to_row", "write_samples"]

log = logging.getLogger(__name__)


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
        # Only stored here: `check` (before the model loads) and `samples` (with the model's limit) check them.
        self.name = name
        self.path = path
        self.metric = metric
        self.max_new_tokens = max_new_tokens
        self.num_samples = num_samples
        self.seq_len = seq_len
        self.chat_template = chat_template
        self.truncation = truncation
        self.max_positions = max_positions

    def _check_settings(self) -> Defaults:
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
        return Defaults(self.name, self.metric, self.max_new_tokens, bool(self.chat_template), self.truncation)

    def check(self) -> None:
        """The settings and the file's presence, before the model loads (the rows are checked in `samples`)."""
        self._check_settings()
        check_file(Path(self.path).expanduser())

    def samples(self, meter: PromptMeter, seed: int) -> list[Sample]:
        """The file's samples (the first `num_samples`), after validating every row. `seed` is unused."""
        defaults = self._check_settings()
        rows = read_rows(Path(self.path).expanduser())
        unknown = sorted({key for row in rows if isinstance(row.data, dict) for key in row.data} - set(COLUMNS))
        if unknown:
            log.warning("custom data %s: ignoring unknown columns %s (known: %s)", self.path, ", ".join(unknown),
                        ", ".join(COLUMNS))
        samples = [parse_row(row, defaults) for row in rows]
        first_row: dict[str, Row] = {}
        for row in rows:
            if row.id in first_row:
                raise row.error("id", f"repeats the id of row {first_row[row.id].index}; ids must be unique "
                                      "(records and resuming are keyed by id)")
            first_row[row.id] = row
        selected = len(rows) if self.num_samples is None else self.num_samples
        for row, sample in zip(rows[:selected], samples[:selected]):
            self._check_length(row, sample, meter)
        return samples[:selected]

    def _check_length(self, row: Row, sample: Sample, meter: PromptMeter) -> None:
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
