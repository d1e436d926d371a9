"""Math-500: the 500-problem MATH test subset of PRM800K (Lightman et al.; problems from Hendrycks et al. 2021),
as used by KeyDiff (App. E) to test KV eviction during long reasoning generations.

Data: `<data_dir>/test.jsonl` in the layout of the HF dataset `HuggingFaceH4/MATH-500` (`problem`, `solution`,
`answer`, `subject`, `level`, `unique_id`), or, with `data_dir` null, through
`load_dataset("HuggingFaceH4/MATH-500", split="test")` (the Hub, or its cache when offline). Problems are taken in
file order; `num_samples` keeps the first N. A relative `data_dir` that is no folder from the working directory
names one of kvbench's packaged data folders (`kvbench/tasks/data/`): `math500_arith` holds six arithmetic problems
written for kvbench in this layout, the offline stand-in of `keydiff_math500_cpu`.

Prompt (KeyDiff gives none; this is DeepSeek's documented usage for its R1-distilled models, which KeyDiff
evaluates): one user message, chat template on, no system prompt:
`<problem>` + `"\\nPlease reason step by step, and put your final answer within \\boxed{}."`. The problem is the
context part and the instruction the question part. Generation stops at EOS or `max_new_tokens`. The prompt is
short, so a method only compresses during decoding here.

Decoding: KeyDiff samples 5 responses per problem ("We randomly sample 5 responses", App. E) and reports the mean
accuracy over them, i.e. pass@1 estimated from 5 samples: each response is its own sample (id
`math500/<unique_id>/<k>`) and a point's score is the mean over all of them, which with the same 5 per problem is
the mean over problems of each problem's mean accuracy. The sampling temperature is lost in the paper text;
temperature 0.6 / top-p 0.95 are DeepSeek's recommended R1 settings (kvbench's choice), with no top-k. Each
sample carries its protocol in `meta["sampling"]` (temperature, top-p and a seed of its own, drawn from the run's
seed, the problem and the response index), and the engine samples with it (`kvbench.engine.decoding`; records say
`decoding`); `engine.sampling=greedy` decodes greedily instead, and `temperature: null` (or 0) makes the protocol
greedy (no `meta["sampling"]`), where `samples_per_problem > 1` would only repeat identical work. The default is
KeyDiff's 5 samples per problem; the greedy points of earlier kvbench versions (one greedy response per problem)
are `task.samples_per_problem=1 engine.sampling=greedy`, which keeps their directories. KeyDiff's generation
limits are 4K, 8K and 32K tokens (its text says 4096, 6144 and "32,786"; its tables say 4K/8K/32K).

Scoring (`kvbench.tasks.math_metrics`): the turn's metric is `math_equiv` (KeyDiff "Flex Match");
`meta["extra_metrics"]` names `math_exact` (KeyDiff "Exact Match"), to be scored on the same prediction.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvbench.tasks.base import PromptMeter, Sample, Task, Turn, check_data_file, jsonl_or_hub_rows, sample_rng

HF_DATASET = "HuggingFaceH4/MATH-500"
INSTRUCTION = "\nPlease reason step by step, and put your final answer within \\boxed{}."
PACKAGED_DATA = Path(__file__).resolve().parent / "data"  # stand-in problem sets shipped with kvbench


HOW_TO_GET = (
    f"Get it (about 0.45 MB) on a machine with Hub access, then either\n"
    f"  huggingface-cli download {HF_DATASET} test.jsonl --repo-type dataset --local-dir DIR\n"
    f"  (then set task.data_dir=DIR), or fill the HF cache with\n"
    f"  python -c \"from datasets import load_dataset; load_dataset('{HF_DATASET}', split='test')\"\n"
    f"  and leave task.data_dir null.")


def data_file(data_dir: str) -> Path:
    """`data_dir/test.jsonl`; a relative `data_dir` that is no folder here may name one of the packaged data."""
    folder = Path(data_dir).expanduser()
    if not folder.is_absolute() and not folder.is_dir() and (PACKAGED_DATA / folder).is_dir():
        folder = PACKAGED_DATA / folder
    return folder / "test.jsonl"


def load_rows(data_dir: str | None) -> list[dict[str, Any]]:
    """All 500 problems, from `data_dir/test.jsonl` when given, else from the Hugging Face Hub (or its cache)."""
    path = None if data_dir is None else data_file(data_dir)
    return jsonl_or_hub_rows(path, HF_DATASET, None, "Math-500 data", HOW_TO_GET)


class Math500(Task):
    """Math-500 problems as single-turn samples, `samples_per_problem` per problem.

    Args:
        name: run label and `Sample.task`.
        seq_len: must be null (real data; the prompt is short and generation is what grows the cache).
        num_samples: first N problems; null = all 500.
        data_dir: folder with `test.jsonl`; null = the Hugging Face Hub (or its cache).
        samples_per_problem: responses per problem (KeyDiff: 5, sampled); each is its own sample.
        max_new_tokens: generation limit (KeyDiff: 4096, 8192, 32768).
        temperature, top_p: the protocol's sampling settings, in `meta["sampling"]` with each sample's seed;
            temperature null or 0: greedy decoding (no `meta["sampling"]`).
    """

    def __init__(
        self,
        name: str = "math500",
        seq_len: int | None = None,
        num_samples: int | None = None,
        data_dir: str | None = None,
        samples_per_problem: int = 5,
        max_new_tokens: int = 4096,
        temperature: float | None = 0.6,
        top_p: float = 0.95,
    ) -> None:
        if seq_len is not None:
            raise ValueError("Math-500 is real data: task.seq_len must be null")
        if samples_per_problem < 1 or max_new_tokens < 1:
            raise ValueError("samples_per_problem and max_new_tokens must be positive")
        if temperature is not None and not temperature >= 0 or not 0 < top_p <= 1:
            raise ValueError(f"temperature must be >= 0 (or null: greedy) and top_p in (0, 1], got {temperature!r}, "
                             f"{top_p!r}")
        self.name = name
        self.num_samples = num_samples
        self.data_dir = data_dir
        self.samples_per_problem = samples_per_problem
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_p = top_p

    def check(self) -> None:
        """A `data_dir` without `test.jsonl`, before the model loads (the Hub is asked later)."""
        if self.data_dir is not None:
            check_data_file(data_file(self.data_dir), "Math-500 data", HOW_TO_GET)

    def samples(self, meter: PromptMeter, seed: int) -> list[Sample]:
        """One sample per (problem, response index). `seed` only derives the per-sample sampling seeds."""
        rows = load_rows(self.data_dir)
        if self.num_samples is not None:
            rows = rows[: self.num_samples]
        sampled = self.temperature is not None and self.temperature > 0
        out = []
        for row in rows:
            for k in range(self.samples_per_problem):
                sampling_seed = sample_rng(seed, self.name, row["unique_id"], k).getrandbits(63)
                out.append(
                    Sample(
                        id=f"{self.name}/{row['unique_id']}/{k}",
                        task=self.name,
                        context=row["problem"],
                        turns=[
                            Turn(
                                question=INSTRUCTION,
                                answers=[row["answer"]],
                                max_new_tokens=self.max_new_tokens,
                                metric="math_equiv",
                            )
                        ],
                        chat_template=True,
                        truncation="error",
                        meta={
                            "benchmark": "math500",
                            "unique_id": row["unique_id"],
                            "subject": row["subject"],
                            "level": row["level"],
                            "sample_index": k,
                            "samples_per_problem": self.samples_per_problem,
                            **({"sampling": {"temperature": self.temperature, "top_p": self.top_p,
                                             "seed": sampling_seed}} if sampled else {}),
                            "extra_metrics": ["math_exact"],
                        },
                    )
                )
        return out
