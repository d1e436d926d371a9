"""How each RULER task builds a sample of a given haystack size (see `kvbench.tasks.ruler` for the protocol and
its deviations from NVIDIA/RULER)."""

from __future__ import annotations

import json
import os
import random
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbench.tasks import haystack as hs
from kvbench.tasks.base import DatasetMissingError, PromptMeter
from kvbench.tasks.ruler_prompts import (
    CWE_ANSWER_PREFIX,
    CWE_TEMPLATE,
    DATA_ENV,
    DEPTHS,
    FWE_ANSWER_PREFIX,
    FWE_TEMPLATE,
    NEEDLE,
    NIAH_ANSWER_PREFIX,
    NIAH_TEMPLATE,
    QA_ANSWER_PREFIX,
    QA_DOCUMENT,
    QA_FILES,
    QA_TEMPLATE,
    VT_ANSWER_PREFIX,
    VT_TEMPLATE,
    Built,
    CweSpec,
    Family,
    FweSpec,
    NiahSpec,
    QaSpec,
    VtSpec,
    random_value,
    singular,
    three_parts,
)


class NiahFamily(Family):
    max_new_tokens = 128

    def __init__(self, spec: NiahSpec, seq_len: int):
        self.spec = spec
        self.num_keys = max(spec.num_keys, spec.num_queries)  # niah.py: num_needle_k = max(k, q)
        self.start = 500 if spec.haystack == "essay" else (5 if seq_len < 4096 else 25)

    def minimum(self, index: int) -> int:
        return self.num_keys * self.spec.num_values  # noise/needle haystacks need a line per needle

    def build(self, rng: random.Random, n: int, index: int) -> Built:
        spec = self.spec
        keys: list[str] = []
        values: list[list[str]] = []
        needles: list[str] = []
        while len(keys) < self.num_keys:
            key = random_value(rng, spec.key_type)
            if key in keys:
                continue
            keys.append(key)
            values.append([random_value(rng, spec.value_type) for _ in range(spec.num_values)])
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
                    key = random_value(rng, spec.key_type)
                    if key not in keys:
                        value = random_value(rng, spec.value_type)
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
            template, prefix, type_v = singular(template), singular(prefix), type_v[:-1]
        context, question, answer_prefix = three_parts(template, prefix, haystack, type_needle_v=type_v, query=query)
        meta["needles"] = [
            {"key": k, "value": v, "char_offset": context.find(NEEDLE.format(type_needle_v=spec.value_type, key=k, value=v))}
            for k, vs in zip(keys, values) for v in vs
        ]
        meta["answer_char_offset"] = context.find(answers[0])
        return Built(context, question, answer_prefix, answers, meta)


class VariableTrackingFamily(Family):
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

    def build(self, rng: random.Random, n: int, index: int) -> Built:
        example, example_answer = self._example(rng, self.icl_size)
        groups, chains, values = self._chains(rng, 5, self.spec.num_hops)
        haystack = self._noise_with_chains(rng, n, chains)
        context, question, answer_prefix = three_parts(
            VT_TEMPLATE, VT_ANSWER_PREFIX, haystack, query=values[0], num_v=self.spec.num_hops + 1)
        # variable_tracking.py: example + " " + answers + "\n", then "\n", then the task prompt.
        context = example + " " + " ".join(example_answer) + "\n" + "\n" + context
        return Built(context, question, answer_prefix, groups[0], {"haystack_size": n, "icl_haystack_size": self.icl_size})


class CommonWordsFamily(Family):
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

    def build(self, rng: random.Random, n: int, index: int) -> Built:
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
        context, question, answer_prefix = three_parts(CWE_TEMPLATE, CWE_ANSWER_PREFIX, listed)
        return Built(shot + "\n" + context, question, answer_prefix, answers,
                      {"haystack_size": n, "extra_vocabulary": n > len(hs.common_words())})


def zeta(alpha: float) -> float:
    """Riemann zeta for alpha > 1 (RULER calls scipy/mpmath): partial sum plus an Euler-Maclaurin tail."""
    if alpha <= 1:
        raise ValueError("FWE needs alpha > 1")
    n = 1000
    return (sum(k ** -alpha for k in range(1, n)) + n ** (1 - alpha) / (alpha - 1) + n ** -alpha / 2
            + alpha * n ** (-alpha - 1) / 12)


class FrequentWordsFamily(Family):
    max_new_tokens = 50
    word_len = 6  # freq_words_extraction.py `coded_wordlen`

    def __init__(self, spec: FweSpec, seq_len: int):
        self.spec = spec
        budget = seq_len - self.max_new_tokens
        self.vocab_size = budget // 50  # freq_words_extraction.py: vocab_size = max_len // 50
        if self.vocab_size < 5:
            raise ValueError(f"seq_len {seq_len} is too small for FWE")
        self.start = max(1, budget // 32)
        self.zeta = zeta(spec.alpha)

    def build(self, rng: random.Random, n: int, index: int) -> Built:
        vocab_set: set[str] = set()
        while len(vocab_set) < self.vocab_size:
            vocab_set.add("".join(rng.choices(string.ascii_lowercase, k=self.word_len)))
        vocab = sorted(vocab_set)
        rng.shuffle(vocab)
        vocab[0] = "..."  # the top-ranked word is noise
        counts = [int(n * k ** -self.spec.alpha / self.zeta) for k in range(1, len(vocab) + 1)]
        words = [w for w, c in zip(vocab, counts) for _ in range(c)]
        rng.shuffle(words)
        context, question, answer_prefix = three_parts(FWE_TEMPLATE, FWE_ANSWER_PREFIX, " ".join(words))
        return Built(context, question, answer_prefix, vocab[1:4], {"haystack_size": n, "vocab_size": self.vocab_size})


@dataclass(frozen=True)
class QaData:
    questions: list[dict[str, Any]]
    documents: list[str]


def qa_path(dataset: str, data_dir: str | None) -> Path:
    filename, url = QA_FILES[dataset]
    root = data_dir or os.environ.get(DATA_ENV)
    path = Path(root) / filename if root else None
    if path is None or not path.is_file():
        where = f"not at {path}" if path else f"no data directory is set (task.data_dir or ${DATA_ENV})"
        raise DatasetMissingError(
            f"RULER {dataset} needs {filename}: {where}. Download it with: wget {url} -O <data_dir>/{filename}")
    return path


_QA_CACHE: dict[tuple[str, str], QaData] = {}


def load_qa(dataset: str, path: Path) -> QaData:
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
    _QA_CACHE[cache_key] = QaData(questions, documents)
    return _QA_CACHE[cache_key]


class QaFamily(Family):
    max_new_tokens = 32
    metric = "string_match_part"

    def __init__(self, spec: QaSpec, data_dir: str | None):
        self.spec = spec
        self.data = load_qa(spec.dataset, qa_path(spec.dataset, data_dir))
        # RULER starts its search at 10 documents; starting at the probe question's own documents also
        # sizes SQuAD samples that fit fewer than 10 paragraphs.
        self.start = self.minimum(0)

    def _question(self, index: int) -> dict[str, Any]:
        if index >= len(self.data.questions):
            raise ValueError(f"{self.spec.dataset} has {len(self.data.questions)} usable questions; sample {index} has none")
        return self.data.questions[index]

    def minimum(self, index: int) -> int:
        return len(self._question(index)["context"])

    def build(self, rng: random.Random, n: int, index: int) -> Built:
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
        context, question, answer_prefix = three_parts(QA_TEMPLATE, QA_ANSWER_PREFIX, haystack, query=q["query"])
        return Built(context, question, answer_prefix, list(q["outputs"]),
                      {"haystack_size": n, "dataset": self.spec.dataset, "question_index": index})


class MultiTurnNiahFamily(NiahFamily):
    """CTKVR's multi-turn NIAH (Table 5): niah_multikey_1's sample with `needles` keys, then every key asked in
    its own turn, in an order drawn per sample (after everything `NiahFamily` draws, so the haystack is its own)."""

    def __init__(self, needles: int, seq_len: int):
        super().__init__(NiahSpec("essay", "words", "numbers", num_keys=needles), seq_len)

    def build(self, rng: random.Random, n: int, index: int) -> Built:
        built = super().build(rng, n, index)
        needles = built.meta["needles"]
        order = rng.sample(range(len(needles)), len(needles))
        turns = []
        for i in order:
            _, question, prefix = three_parts(singular(NIAH_TEMPLATE), singular(NIAH_ANSWER_PREFIX), "",
                                               type_needle_v="number", query=needles[i]["key"])
            turns.append((question if not turns else question.lstrip("\n"), prefix, [needles[i]["value"]]))
        built.question, built.answer_prefix, built.answers = turns[0]
        built.follow_ups = turns[1:]
        built.meta["turn_keys"] = [needles[i]["key"] for i in order]
        built.meta["answer_char_offset"] = built.context.find(built.answers[0])
        return built
