"""A claim: a paper's observation about attention, its measurement on one sample, and the rule that turns the
per-sample effects into a verdict.

Every claim records one number per sample, its `effect`; the measured value is their mean, with a 95%
percentile-bootstrap interval over samples (`kvbench.results.stats.bootstrap_interval`, seeded by the run). The verdict compares that interval with
the claim's `threshold` on the side the paper states (`holds_when`): the whole interval on that side is
"holds", the whole interval on the other side "does_not_hold", an interval across it "inconclusive". Fewer
than `MIN_SAMPLES` samples is always "inconclusive" (no interval worth the name), except for a claim that
measures no sample (a worked example, exact by construction).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from kvbench.analysis.trace import Trace
from kvbench.results.stats import bootstrap_interval
from kvbench.tasks.base import Sample

MIN_SAMPLES = 3
VERDICTS = ("holds", "does_not_hold", "inconclusive")

_CLAIMS: dict[str, type["Claim"]] = {}


def register_claim(cls: type["Claim"]) -> type["Claim"]:
    _CLAIMS[cls.name] = cls
    return cls


@dataclasses.dataclass
class Claim:
    """One claim; its dataclass fields are its parameters (the paper's defaults), set from `params.<name>`."""

    name: ClassVar[str]
    paper: ClassVar[str]
    source: ClassVar[str]  # where the paper shows it, e.g. "Fig. 2"
    statement: ClassVar[str]  # the observation, in the paper's terms
    paper_number: ClassVar[str]  # what the paper reports
    effect_name: ClassVar[str]  # what `effect` measures, with its unit
    threshold: ClassVar[float]
    holds_when: ClassVar[str]  # "above" or "below": the side of `threshold` the paper's wording puts it
    needs_samples: ClassVar[bool] = True  # False: a worked example, measured once without a model
    new_tokens: int = 0  # greedy decode steps captured after the prompt (0: prompt only)

    def measure(self, trace: Trace, sample: Sample, seed: int) -> dict[str, Any]:
        """The raw measurements of one sample, with its scalar `effect`."""
        raise NotImplementedError

    def measure_once(self) -> dict[str, Any]:
        """A claim without samples: its one record."""
        raise NotImplementedError

    def condition(self, records: Sequence[dict[str, Any]]) -> tuple[bool, str] | None:
        """A second condition the paper's wording adds to the threshold (None: none); with its description."""
        return None

    def figure(self, records: Sequence[dict[str, Any]]) -> Any:
        """The paper's figure, drawn from the records (a matplotlib Figure)."""
        raise NotImplementedError

    def rule(self) -> str:
        side = ">" if self.holds_when == "above" else "<"
        return (f"holds if the 95% bootstrap interval of the mean {self.effect_name} lies {self.holds_when} "
                f"{self.threshold:g} ({side} {self.threshold:g}); does_not_hold if it lies wholly on the other side")


def registered() -> dict[str, type[Claim]]:
    """The claims registered so far, by name (`kvbench.analysis.runner.claims` imports them all first)."""
    return dict(sorted(_CLAIMS.items()))


def verdict(claim: Claim, records: Sequence[dict[str, Any]], seed: int) -> dict[str, Any]:
    """The verdict of `claim` over its records (the module docstring's rule)."""
    effects = [r["effect"] for r in records]
    effect = float(np.mean(effects))
    if claim.needs_samples:  # one sample has no interval (None), not a zero-width one
        low, high = bootstrap_interval(effects, seed=seed) or (None, None)
    else:  # a worked example: exact, no sampling
        low = high = effect
    above = claim.holds_when == "above"
    on_side = low is not None and (low > claim.threshold if above else high < claim.threshold)
    off_side = low is not None and (high < claim.threshold if above else low > claim.threshold)
    outcome = "holds" if on_side else "does_not_hold" if off_side else "inconclusive"
    rule = claim.rule()
    extra = claim.condition(records)
    if extra is not None:
        met, described = extra
        rule += f"; and {described}"
        if outcome == "holds" and not met:
            outcome = "does_not_hold"
    if claim.needs_samples and len(records) < MIN_SAMPLES:
        outcome = "inconclusive"
        rule += f"; fewer than {MIN_SAMPLES} samples is inconclusive"
    details = {key: float(np.mean([r[key] for r in records])) for key, value in records[0].items()
               if key != "effect" and isinstance(value, (int, float)) and not isinstance(value, bool)}
    return {"claim": claim.name, "paper": claim.paper, "source": claim.source, "statement": claim.statement,
            "paper_number": claim.paper_number, "effect_name": claim.effect_name, "verdict": outcome,
            "effect": effect, "ci_low": low, "ci_high": high, "n": len(records), "threshold": claim.threshold,
            "rule": rule, "params": dataclasses.asdict(claim), "details": details}
