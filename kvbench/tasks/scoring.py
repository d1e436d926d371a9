"""Metric registry: every scorer maps (prediction, gold answers, **metric_args) to a score in [0, 1].

Task modules register their scorers with `@register("name")`; a `Turn` names its metric, so a sample is
scored without knowing which task made it. Scorers are pure functions of strings (no model, no state).
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

Scorer = Callable[..., float]  # (prediction: str, answers: list[str], **metric_args) -> float
SCORERS: dict[str, Scorer] = {}

# Modules whose import registers scorers; imported on first lookup so `score` works from anywhere.
SCORER_MODULES = [
    "kvbench.tasks.metrics",
    "kvbench.tasks.longbench_metrics",
    "kvbench.tasks.scbench_metrics",
    "kvbench.tasks.math_metrics",
    "kvbench.tasks.generic_metrics",
    "kvbench.tasks.infinitebench_metrics",
]


def register(name: str) -> Callable[[Scorer], Scorer]:
    def wrap(fn: Scorer) -> Scorer:
        if name in SCORERS and SCORERS[name] is not fn:
            raise ValueError(f"metric {name!r} registered twice")
        SCORERS[name] = fn
        return fn

    return wrap


def get_scorer(name: str) -> Scorer:
    for module in SCORER_MODULES:
        importlib.import_module(module)
    if name not in SCORERS:
        raise KeyError(f"unknown metric {name!r}; known: {', '.join(sorted(SCORERS))}")
    return SCORERS[name]


def score(metric: str, prediction: str, answers: list[str], **metric_args: Any) -> float:
    return float(get_scorer(metric)(prediction, answers, **metric_args))
