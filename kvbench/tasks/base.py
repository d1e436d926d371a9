"""What every task produces: self-describing samples.

A task module turns a config (sequence length, number of samples, seed, data location) into a list of
`Sample`s. A sample carries everything the engine and the scorer need, so the engine never has to know
which task it is running:

- the three-part prompt (context, then per turn a question and an answer prefix), so that the
  question-aware mode (compress context+question) and the question-agnostic mode (compress the context
  alone, then append the question) run on the same token sequence;
- per turn: the gold answers, the metric name (a key of `kvbench.tasks.scoring.SCORERS`) and the maximum
  number of new tokens;
- whether the model's chat template wraps the prompt, and extra stop strings.

Lengths are measured in tokens of the evaluated model, with its chat template, through a `PromptMeter`
that the engine supplies (tests use a whitespace meter).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from hydra.errors import InstantiationException
from hydra.utils import get_class, instantiate
from omegaconf import OmegaConf

from kvbench.core.checks import check_argument_kinds
from kvbench.core.errors import KVBenchError


@dataclass
class Turn:
    """One question of a sample. Single-turn tasks have exactly one."""

    question: str
    answers: list[str]
    max_new_tokens: int
    metric: str
    answer_prefix: str = ""
    # Keyword arguments of the scorer beyond (prediction, answers), e.g. LongBench classification's class list.
    metric_args: dict[str, Any] = field(default_factory=dict)


@dataclass
class Sample:
    id: str
    task: str  # the (sub)task name, e.g. "ruler_niah_single_1"; suites mix several in one run
    context: str
    turns: list[Turn]
    chat_template: bool = True
    stop: list[str] = field(default_factory=list)  # stop strings on top of the model's EOS tokens
    # What to do when the prompt exceeds the model's input limit: "error" (synthetic tasks are sized to fit,
    # so overflow is a configuration error) or "middle" (LongBench/SCBench protocol: keep the first and last
    # halves of the context tokens).
    truncation: str = "error"
    meta: dict[str, Any] = field(default_factory=dict)  # JSON-serialisable facts: depth, needle offset, ...
    # A prompt given as token ids instead of text (synthetic efficiency inputs): {"kind": "random" | "repeat",
    # "length": n, "seed": s}; the engine's prompt builder draws the ids from the model's vocabulary.
    token_prompt: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def digest(self) -> str:
        """sha256 of everything the sample is (prompt parts, answers, settings, meta): records carry it, so a
        resumed point notices when a task now generates a sample of the same id differently. Samples are not
        changed once built, so it is computed once."""
        if "_digest" not in self.__dict__:  # once per sample: a sweep asks for it once per point and record
            text = json.dumps(self.to_dict(), sort_keys=True, ensure_ascii=False, default=str)
            self.__dict__["_digest"] = hashlib.sha256(text.encode("utf-8")).hexdigest()
        return self.__dict__["_digest"]

    @classmethod
    def from_dict(cls, row: dict[str, Any]) -> "Sample":
        row = dict(row)
        row["turns"] = [Turn(**t) for t in row["turns"]]
        return cls(**row)


class PromptMeter(Protocol):
    """Token count of the prompt the engine would build for (context, question, answer_prefix)."""

    def __call__(self, context: str, question: str = "", answer_prefix: str = "", chat_template: bool = True) -> int: ...


def whitespace_meter(context: str, question: str = "", answer_prefix: str = "", chat_template: bool = True) -> int:
    """A model-free meter for tests and dry runs: one token per whitespace-separated word."""
    return len(f"{context} {question} {answer_prefix}".split())


class Task:
    """Base class: subclasses set `name` and implement `samples`."""

    name: str = "task"
    # The evaluated model's limit on prompt + generated tokens; the runner sets it before `samples` so that a
    # task reading user data can refuse an over-long row up front (synthetic tasks size themselves instead).
    max_positions: int | None = None

    def samples(self, meter: PromptMeter, seed: int) -> list[Sample]:
        raise NotImplementedError

    def check(self) -> None:
        """Refuse, before the model loads, what the task can tell from its settings alone (a data file that is
        not there; not its rows, which need the tokenizer). Raises KVBenchError; the default has nothing to
        check."""


def build_task(task_cfg: Any) -> Task:
    """The task a `kvbench/conf/task/*.yaml` node names. A setting of another kind than its constructor's
    annotation (`task.chat_template=maybe`) and a task's word on its settings (a ValueError, also when raised
    through Hydra's instantiation) become one KVBenchError line naming the task."""
    try:
        settings = OmegaConf.to_container(task_cfg, resolve=True)
        check_argument_kinds(get_class(settings.pop("_target_")).__init__, settings)
        return instantiate(task_cfg, _convert_="all")
    except (ValueError, InstantiationException) as exc:
        raise task_error(task_cfg.name, exc) from exc


def task_error(name: str, exc: Exception) -> KVBenchError:
    """`task NAME: what it said`, the cause of a failed instantiation rather than Hydra's wrapper."""
    cause = exc.__cause__ if isinstance(exc, InstantiationException) and exc.__cause__ else exc
    return KVBenchError(f"task {name}: {cause}")


def sample_rng(seed: int, *parts: Any) -> random.Random:
    """A private RNG for one sample, derived from the run seed and the sample's identity.

    Never touch the global `random` state: samples must not depend on generation order.
    """
    digest = hashlib.sha256(repr((seed, *parts)).encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "little"))


def load_hf_rows(path: str, name: str | None, split: str) -> list[dict[str, Any]] | None:
    """Rows of a Hugging Face dataset (downloaded, or from the local cache), or None when unavailable.

    Set HF_HUB_OFFLINE=1 on machines without Hub access: `datasets` then reads only the cache and fails at
    once instead of retrying the network for ~25 s.
    """
    import datasets

    try:
        dataset = datasets.load_dataset(path, name, split=split)
    except (ConnectionError, FileNotFoundError, OSError, ValueError):
        return None
    return [dict(row) for row in dataset]


def read_jsonl(path: Path, required: Sequence[str], benchmark: str) -> list[dict[str, Any]]:
    """The rows of a benchmark's JSON-lines file (blank lines skipped); a row without one of the `required` keys
    is a ValueError naming the file, the line and the keys."""
    rows = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            missing = [k for k in required if k not in row]
            if missing:
                raise ValueError(f"{path}:{lineno}: {benchmark} row lacks {missing}")
            rows.append(row)
    return rows


def subset_files(data_dir: Path, names: dict[str, str], missing: Callable[[list[str], str], str]) -> dict[str, Path]:
    """Each subset's `<name>.jsonl` in `data_dir` or `data_dir/data` (`names`: subset -> file name). Any not there:
    a `DatasetMissingError` with `missing(file names, where they were looked for)` as its message."""
    paths = {}
    for subset, name in names.items():
        found = next((p for p in (data_dir / f"{name}.jsonl", data_dir / "data" / f"{name}.jsonl") if p.is_file()),
                     None)
        if found is not None:
            paths[subset] = found
    absent = [name for subset, name in names.items() if subset not in paths]
    if absent:
        files = ", ".join(f"{name}.jsonl" for name in absent)
        raise DatasetMissingError(missing(absent, f"no {files} in {data_dir} or {data_dir / 'data'}"))
    return paths


def check_data_file(path: Path, what: str, how: str) -> None:
    """A `DatasetMissingError` (as `jsonl_or_hub_rows` raises it) where the file `path` is not there."""
    if not path.is_file():
        raise DatasetMissingError(f"{what} not found: {path} does not exist. {how}")


def jsonl_or_hub_rows(path: Path | None, dataset: str, config: str | None, what: str, how: str) -> list[dict[str, Any]]:
    """The rows of the JSON-lines file `path` (blank lines skipped) when given, else of the test split of the
    Hugging Face dataset `dataset` (its `config`; from the Hub, or its cache). Neither there: a
    `DatasetMissingError` that says `what` was not found, where it was looked for, and `how` to get it."""
    if path is not None:
        check_data_file(path, what, how)
        return read_jsonl(path, (), what)
    rows = load_hf_rows(dataset, config, "test")
    if rows is not None:
        return rows
    named = repr(dataset) if config is None else f"{dataset!r} (config {config!r})"
    where = f"task.data_dir is null and {named} could not be loaded from the Hugging Face Hub or its cache"
    raise DatasetMissingError(f"{what} not found: {where}. {how}")


class DatasetMissingError(KVBenchError):
    """A task needs data that is not on this machine; the message says how to get it."""
