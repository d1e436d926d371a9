"""Task-neutral metric names for bring-your-own data (`task=custom`), as aliases of existing scorers.

A custom dataset names its metric with a plain word rather than a benchmark-prefixed one. Each name below is
the same function object as the scorer it aliases (so the two names always give the same number), except
`exact_match`, which is new. Every scorer takes the prediction and the list of gold answers and returns a
score in [0, 1]; "max over golds" means the best score against any one gold.

| name                | computes                                                             | same as              |
| ------------------- | -------------------------------------------------------------------- | -------------------- |
| `string_match_all`  | share of golds contained, case-insensitively, in the prediction      | (RULER, metrics.py)  |
| `string_match_part` | 1 if any gold is contained, case-insensitively, in the prediction    | (RULER, metrics.py)  |
| `qa_f1`             | token F1 after `normalize_answer` (below), max over golds            | `longbench_qa_f1`    |
| `rouge_l`           | ROUGE-L F of the `rouge==1.0.1` package (LCS of whitespace words,    | `longbench_rouge`    |
|                     | summary-level over "."-split sentences), max over golds; 0 when the  |                      |
|                     | library raises (empty prediction)                                    |                      |
| `exact_match`       | 1 if `normalize_answer(prediction) == normalize_answer(gold)` for    | (new)                |
|                     | some gold                                                            |                      |
| `code_sim`          | `fuzz.ratio / 100` of the first prediction line without "`", "#" or  | `longbench_code_sim` |
|                     | "//" against the gold (LongBench lcc/repobench-p), max over golds    |                      |
| `math_equiv`        | last `\\boxed{}` of the prediction equals a gold under the MATH      | (math_metrics.py)    |
|                     | normaliser, or math-verify finds them equivalent                     |                      |

`normalize_answer` (LongBench's, itself SQuAD's): lower-case, delete ASCII punctuation, delete the words
a/an/the, collapse whitespace. So `exact_match` counts "The Eiffel Tower." equal to "eiffel tower", but
"42" not equal to "42 metres": use `qa_f1` or `string_match_part` for answers embedded in longer text.
"""

from __future__ import annotations

# Importing these modules registers the scorers named below (string_match_*, math_equiv, longbench_*).
from kvbench.tasks import math_metrics, metrics  # noqa: F401
from kvbench.tasks.longbench_metrics import normalize_answer
from kvbench.tasks.scoring import SCORERS, register

GENERIC_METRICS = (
    "string_match_all",
    "string_match_part",
    "qa_f1",
    "rouge_l",
    "exact_match",
    "code_sim",
    "math_equiv",
)

# Registering the very objects (not copies) keeps an alias and its original identical by construction.
register("qa_f1")(SCORERS["longbench_qa_f1"])
register("rouge_l")(SCORERS["longbench_rouge"])
register("code_sim")(SCORERS["longbench_code_sim"])


@register("exact_match")
def exact_match(prediction: str, answers: list[str]) -> float:
    """1 if the normalised prediction equals some normalised gold answer, else 0 (see module docstring)."""
    if not answers:
        raise ValueError("a scorer got no reference answers; the sample is malformed")
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(gold) for gold in answers))
