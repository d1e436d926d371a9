"""RULER's prompt templates, task table and the base of its sample builders (see `kvbench.tasks.ruler`)."""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass, field
from typing import Any

from kvbench.tasks import haystack as hs

# --- RULER's templates (scripts/data/synthetic/constants.py) and needle format (niah.py) ---
NIAH_TEMPLATE = (
    "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {type_needle_v} afterwards.\n{context}\n"
    "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?"
)
NIAH_ANSWER_PREFIX = " The special magic {type_needle_v} for {query} mentioned in the provided text are"
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."

VT_TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
    "Question: Find all variables that are assigned the value {query} in the text above."
)
VT_ANSWER_PREFIX = (
    " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
    "assigned the value {query}, they are: "
)

CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n{context}\n"
    "Question: What are the 10 most common words in the above list?"
)
CWE_ANSWER_PREFIX = " Answer: The top 10 words that appear most often in the list are:"

FWE_TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. Find the three most "
    "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore "
    "the dots '....'. What are the three most frequently appeared words in the above coded text?"
)
FWE_ANSWER_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"

QA_TEMPLATE = (
    "Answer the question based on the given documents. Only give me the answer and do not output any "
    "other words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the "
    "given documents. Only give me the answer and do not output any other words.\n\nQuestion: {query}"
)
QA_ANSWER_PREFIX = " Answer:"
QA_DOCUMENT = "Document {i}:\n{document}"

# niah.py: 40 evenly spaced depths in [0, 100], rounded to integers (np.round(np.linspace(0, 100, 40))).
DEPTHS = tuple(round(100 * i / 39) for i in range(40))

QA_FILES = {
    "squad": ("dev-v2.0.json", "https://rajpurkar.github.io/SQuAD-explorer/dataset/dev-v2.0.json"),
    "hotpotqa": ("hotpot_dev_distractor_v1.json", "http://curtis.ml.cmu.edu/datasets/hotpot/hotpot_dev_distractor_v1.json"),
}
DATA_ENV = "KVBENCH_DATA"


# --- task table (scripts/synthetic.yaml) ---
@dataclass(frozen=True)
class NiahSpec:
    haystack: str  # "noise" (RULER's "repeat"), "essay" or "needle"
    key_type: str  # "words", "numbers" or "uuids"
    value_type: str
    num_keys: int = 1
    num_values: int = 1
    num_queries: int = 1


@dataclass(frozen=True)
class VtSpec:
    num_chains: int = 1
    num_hops: int = 4


@dataclass(frozen=True)
class CweSpec:
    freq_cw: int = 30
    freq_ucw: int = 3


@dataclass(frozen=True)
class FweSpec:
    alpha: float = 2.0


@dataclass(frozen=True)
class QaSpec:
    dataset: str  # "squad" or "hotpotqa"


RULER_TASKS: dict[str, NiahSpec | VtSpec | CweSpec | FweSpec | QaSpec] = {
    "niah_single_1": NiahSpec("noise", "words", "numbers"),
    "niah_single_2": NiahSpec("essay", "words", "numbers"),
    "niah_single_3": NiahSpec("essay", "words", "uuids"),
    "niah_multikey_1": NiahSpec("essay", "words", "numbers", num_keys=4),
    "niah_multikey_2": NiahSpec("needle", "words", "numbers"),
    "niah_multikey_3": NiahSpec("needle", "uuids", "uuids"),
    "niah_multivalue": NiahSpec("essay", "words", "numbers", num_values=4),
    "niah_multiquery": NiahSpec("essay", "words", "numbers", num_queries=4),
    "vt": VtSpec(),
    "cwe": CweSpec(),
    "fwe": FweSpec(),
    "qa_1": QaSpec("squad"),
    "qa_2": QaSpec("hotpotqa"),
}


@dataclass
class Built:
    context: str
    question: str
    answer_prefix: str
    answers: list[str]
    meta: dict[str, Any] = field(default_factory=dict)
    follow_ups: list[tuple[str, str, list[str]]] = field(default_factory=list)  # later turns: question, prefix, answers


def three_parts(template: str, answer_prefix: str, context: str, **fields: Any) -> tuple[str, str, str]:
    head, tail = template.split("{context}")
    return head.format(**fields) + context, tail.format(**fields), answer_prefix.format(**fields)


def random_value(rng: random.Random, kind: str) -> str:
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "words":
        return hs.random_key_word(rng)
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"unknown needle type {kind!r}")


def singular(text: str) -> str:
    """RULER's rewrite of the NIAH template when exactly one value is asked for (niah.py)."""
    for old, new in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
        text = text.replace(old, new)
    return text


class Family:
    """How one RULER task builds a sample of haystack size n and how its size is searched."""

    max_new_tokens: int
    metric: str = "string_match_all"
    start: int  # smallest size probed by the search (RULER's `incremental` lower bound)

    def minimum(self, index: int) -> int:
        return 1

    def build(self, rng: random.Random, n: int, index: int) -> Built:
        raise NotImplementedError
