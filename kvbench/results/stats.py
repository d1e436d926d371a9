"""The uncertainty of kvbench's numbers: every interval, paired comparison and sample-size estimate comes from here.

A score cell is a mean over samples, or for a suite the unweighted mean of its subtasks' means (RULER's rule,
`summary.mean_of_subtasks`). Its interval is a 95% percentile bootstrap over samples: each of `RESAMPLES`
resamples draws, within every subtask, as many samples as that subtask has, with replacement, and recomputes
the printed number; the interval is the 2.5th and 97.5th percentiles of those numbers (numpy's linear
interpolation, as `scipy.stats.bootstrap(method="percentile")`, which it equals for one subtask and one seed).
Stratifying by subtask keeps each subtask's weight fixed, so the interval is of the number printed, not of a
pooled sample mean. The generator is seeded with `SEED` on every call and the samples are taken in (subtask,
sample id) order, so an interval depends on the records alone: re-running a report gives the same numbers.

Several sampled responses to one prompt (Math-500's five per problem, KeyDiff's protocol) are not independent
samples: the problem's difficulty is shared by its responses. Such records form one cluster (`sample_cluster`:
a sample whose meta says `samples_per_problem` > 1 belongs to its `unique_id`), and the bootstrap resamples
clusters, each standing for the mean of its responses (a cluster bootstrap): resampling the responses one by one
would treat five correlated draws as five problems and give too narrow an interval. The printed number is
still the mean over responses (pass@1), the mean of the clusters' means when every problem has its responses,
and `n` still counts responses; reports say which unit their intervals resampled (`resampled_unit`). The
detectable difference below takes the same unit: the variance of the problems' mean differences, and the
samples per subtask it asks for are problems (Math-500's `task.num_samples`).

An interval needs at least two samples in every subtask: a subtask with one sample has no spread to resample
(a bootstrap over it would report zero width, a certainty the data cannot give), so such a cell has none.
A cell whose samples all score alike gets a zero-width interval: the bootstrap sees no variation, which with
few samples is not the same as knowing the true score (nine failures are compatible with a third succeeding).
With few samples per subtask the percentile bootstrap is also narrow: a resample's mean varies by (n - 1) / n
of the sample variance over n, so at 3 samples per subtask its intervals are about a fifth too narrow, at 20
about 3%.

A paired comparison is the same bootstrap over the per-sample differences of two points on the samples they
share (same subtask, sample id and sample content digest): every method of a sweep runs on the same prompts,
and pairing removes the prompts' difficulty from the comparison. Its interval containing 0 means the two
points are not distinguishable at this sample count.

The smallest detectable difference of a set of comparisons is (z(1 - alpha/2) + z(power)) x the standard
error of a paired difference, 2.80 x SE for a two-sided 5% test with 80% power (normal approximation; with
fewer than about 30 pairs it is optimistic). The SE comes from the observed within-subtask variance of the
paired differences, pooled (averaged) over the comparisons; the samples per subtask that would detect a
difference d follow from the same formula solved for n.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from statistics import NormalDist
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import pandas as pd

CONFIDENCE = 0.95
RESAMPLES = 2000
SEED = 0
ALPHA = 0.05  # the detectable difference's two-sided test
POWER = 0.80  # ... and its power
_CHUNK = 1 << 22  # resampled values held at once: a 6,500-sample cell would otherwise take 100 MB of indices


@dataclasses.dataclass(frozen=True)
class Estimate:
    """A number with its sample count and 95% interval (`low`, `high` None: no interval, see the module doc)."""

    value: float
    n: int
    low: float | None = None
    high: float | None = None

    @property
    def has_interval(self) -> bool:
        return self.low is not None and self.high is not None

    @property
    def excludes_zero(self) -> bool:
        """A paired difference whose interval lies wholly on one side of 0: the two points are distinguishable."""
        return self.has_interval and (self.low > 0 or self.high < 0)

    def interval_text(self, digits: int = 1) -> str:
        """`[37.8, 60.0]`, or `-` without an interval."""
        return f"[{self.low:.{digits}f}, {self.high:.{digits}f}]" if self.has_interval else "-"

    def text(self, digits: int = 1) -> str:
        """`48.9 [37.8, 60.0]`, or `48.9` without an interval."""
        value = f"{self.value:.{digits}f}"
        return f"{value} {self.interval_text(digits)}" if self.has_interval else value


def _strata(values: Sequence[float], strata: Sequence[Any] | None) -> tuple[list[str], list[np.ndarray]]:
    """The strata's names (sorted) and the values of each, in the order given."""
    values = np.asarray(values, dtype=float)
    if strata is None:
        return [""], [values]
    labels = np.asarray([str(s) for s in strata])
    if len(labels) != len(values):
        raise ValueError(f"{len(values)} values but {len(labels)} strata")
    names = sorted(set(labels))
    return names, [values[labels == name] for name in names]


def _weights(names: list[str], weights: Mapping[str, float] | None) -> np.ndarray:
    """Each stratum's weight in the number: equal (the mean of the strata's means) unless `weights` says,
    relative weights normalised over the strata present (a subtask two points do not share drops out)."""
    if weights is None:
        return np.full(len(names), 1 / len(names))
    missing = [n for n in names if n not in weights]
    if missing:
        raise ValueError(f"no weight for strata {missing}")
    given = np.asarray([weights[n] for n in names], dtype=float)
    return given / given.sum()


def mean_of_strata(values: Sequence[float], strata: Sequence[Any] | None = None,
                   weights: Mapping[str, float] | None = None) -> float:
    """The unweighted mean of the strata's means (the mean of `values` without strata); with `weights`
    (stratum -> relative weight), their weighted mean: a category average's subtasks weigh less."""
    names, groups = _strata(values, strata)
    if not groups or not all(len(g) for g in groups):
        raise ValueError("no values")
    return float(np.dot(_weights(names, weights), [g.mean() for g in groups]))


PROBLEM = "problem:"  # a cluster of sampled responses to one problem (`sample_cluster`); "sample:" is a lone sample


def sample_cluster(sample_id: Any, meta: Mapping[str, Any] | None) -> str:
    """What the bootstrap resamples a record as part of: the problem a sampled response answers, where a task
    draws several responses per problem (its meta's `samples_per_problem` > 1 and `unique_id`: Math-500), else
    the sample itself."""
    meta = meta or {}
    if (meta.get("samples_per_problem") or 1) > 1 and meta.get("unique_id") is not None:
        return f"{PROBLEM}{meta['unique_id']}"
    return f"sample:{sample_id}"


def resampled_unit(clusters: Sequence[Any] | None, samples: Sequence[Any]) -> str:
    """What a bootstrap over records with these clusters (`sample_cluster`) and sample ids resamples, as a report
    says it: "samples", or where the records are sampled responses, "problems (each with its 5 sampled
    responses; n counts responses)" (a range where problems have different counts, each point's counted once:
    the distinct sample ids of a problem), and "..., samples elsewhere" where some records are lone samples."""
    if clusters is None:
        return "samples"
    if len(clusters) != len(samples):
        raise ValueError(f"{len(clusters)} clusters but {len(samples)} samples")
    responses: dict[str, set[str]] = {}
    lone = False
    for cluster, sample in zip(clusters, samples):
        if str(cluster).startswith(PROBLEM):
            responses.setdefault(str(cluster), set()).add(str(sample))
        else:
            lone = True
    if not responses:
        return "samples"
    low, high = min(map(len, responses.values())), max(map(len, responses.values()))
    each = f"{low}" if low == high else f"{low}-{high}"
    return (f"problems (each with its {each} sampled response{'s' if high > 1 else ''}; n counts responses)"
            + (", samples elsewhere" if lone else ""))


def frame_resampled_unit(frame: "pd.DataFrame") -> str:
    """`resampled_unit` of a frame of `kvbench.results.load` (its `cluster` and `sample_id` columns)."""
    if "cluster" not in frame.columns or "sample_id" not in frame.columns:
        return "samples"
    return resampled_unit(frame["cluster"].astype(str).tolist(), frame["sample_id"].astype(str).tolist())


def cluster_means(values: Sequence[float], strata: Sequence[Any] | None,
                  clusters: Sequence[Any]) -> tuple[np.ndarray, np.ndarray | None]:
    """One value per (stratum, cluster), the mean of its values, in the order the clusters first appear, and
    their strata (None without strata): what a cluster bootstrap resamples."""
    values = np.asarray(values, dtype=float)
    labels = [""] * len(values) if strata is None else [str(x) for x in strata]
    if len(clusters) != len(values) or len(labels) != len(values):
        raise ValueError(f"{len(values)} values but {len(clusters)} clusters and {len(labels)} strata")
    groups: dict[tuple[str, str], list[float]] = {}
    for value, label, cluster in zip(values, labels, clusters):
        groups.setdefault((label, str(cluster)), []).append(value)
    means = np.asarray([np.mean(group) for group in groups.values()])
    return means, None if strata is None else np.asarray([label for label, _ in groups])


def bootstrap_interval(values: Sequence[float], strata: Sequence[Any] | None = None, *,
                       weights: Mapping[str, float] | None = None, seed: int = SEED, resamples: int = RESAMPLES,
                       level: float = CONFIDENCE, clusters: Sequence[Any] | None = None) -> tuple[float, float] | None:
    """Percentile-bootstrap interval of `mean_of_strata`, resampling within each stratum; None when a stratum
    has fewer than two values. With `clusters` (one per value, `sample_cluster`), the clusters are resampled,
    each as the mean of its values; None when a stratum has fewer than two clusters. Clusters that each hold one
    value change nothing: the plain bootstrap, bitwise."""
    if clusters is not None and len({str(c) for c in clusters}) < len(clusters):
        values, strata = cluster_means(values, strata, clusters)
    names, groups = _strata(values, strata)
    if not groups or any(len(g) < 2 for g in groups):
        return None
    rng = np.random.default_rng(seed)
    means = np.zeros(resamples)
    for weight, group in zip(_weights(names, weights), groups):  # in chunks of rows: one draw's stream
        rows = max(1, _CHUNK // len(group))
        for start in range(0, resamples, rows):
            stop = min(resamples, start + rows)
            draw = rng.integers(0, len(group), size=(stop - start, len(group)))
            means[start:stop] += weight * group[draw].mean(axis=1)
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(means, [tail, 100 - tail])
    return float(low), float(high)


def estimate(values: Sequence[float], strata: Sequence[Any] | None = None, *,
             weights: Mapping[str, float] | None = None, seed: int = SEED,
             clusters: Sequence[Any] | None = None) -> Estimate:
    """`mean_of_strata` with its sample count and `bootstrap_interval` (over `clusters` where given)."""
    interval = bootstrap_interval(values, strata, weights=weights, seed=seed, clusters=clusters)
    low, high = interval if interval is not None else (None, None)
    return Estimate(mean_of_strata(values, strata, weights), len(values), low, high)


def _sorted_scores(frame: "pd.DataFrame", value: str, stratum: str, sample: str) -> "pd.DataFrame":
    import pandas as pd

    out = frame.assign(**{value: pd.to_numeric(frame[value], errors="coerce")}).dropna(subset=[value])
    return out.assign(_stratum=out[stratum].astype(str), _sample=out[sample].astype(str)).sort_values(
        ["_stratum", "_sample"], kind="stable")


def frame_estimate(frame: "pd.DataFrame", value: str = "score", stratum: str = "subtask",
                   sample: str = "sample_id", weights: Mapping[str, float] | None = None) -> Estimate | None:
    """The `estimate` of one cell's records (a frame of `kvbench.results.load`, `value` in the units shown),
    stratified by subtask, samples in (subtask, sample id) order; None when no record has a value."""
    rows = _sorted_scores(frame, value, stratum, sample)
    if not len(rows):
        return None
    return estimate(rows[value].to_numpy(), rows["_stratum"].to_numpy(), weights=weights, clusters=_clusters(rows))


def _clusters(rows: "pd.DataFrame") -> list[str] | None:
    """The frame's `cluster` column (`kvbench.results.collect.load` writes it: `sample_cluster`), if it has one."""
    return rows["cluster"].astype(str).tolist() if "cluster" in rows.columns else None


# What makes two records the same sample: a sample id names a prompt only together with its subtask, and the
# digest of its content tells a prompt a later code version generates differently (older records have none).
SAMPLE_KEYS = ("subtask", "sample_id", "sample_digest")


def paired_differences(frame: "pd.DataFrame", reference: "pd.DataFrame", value: str = "score") -> "pd.DataFrame":
    """The records of `frame` and `reference` on the samples they share (`SAMPLE_KEYS`), with `diff` = the
    frame's value minus the reference's, in (subtask, sample id) order."""
    keys = [k for k in SAMPLE_KEYS if k in frame.columns and k in reference.columns]
    keys += ["cluster"] if "cluster" in frame.columns and "cluster" in reference.columns else []
    mine = _sorted_scores(frame, value, "subtask", "sample_id")[[*keys, value]]
    theirs = _sorted_scores(reference, value, "subtask", "sample_id")[[*keys, value]]
    both = mine.merge(theirs, on=keys, suffixes=("", "_reference"))  # NaN digests (old records) pair alike
    both["diff"] = both[value] - both[f"{value}_reference"]
    return both.sort_values(["subtask", "sample_id"], key=lambda s: s.astype(str), kind="stable")


def paired_estimate(frame: "pd.DataFrame", reference: "pd.DataFrame", value: str = "score",
                    weights: Mapping[str, float] | None = None) -> Estimate | None:
    """The mean paired difference (frame - reference) over the shared samples, stratified by subtask (weighted
    as the cell, `weights`), with its bootstrap interval; None when they share no sample."""
    both = paired_differences(frame, reference, value)
    if both.empty:
        return None
    return estimate(both["diff"].to_numpy(), both["subtask"].astype(str).to_numpy(), weights=weights,
                    clusters=_clusters(both))


@dataclasses.dataclass(frozen=True)
class Detectable:
    """What a set of paired comparisons can resolve: the difference detectable at their sample counts, and the
    samples per subtask (`task.num_samples`) that would detect `goal`."""

    difference: float  # in the units of the values (score points)
    goal: float
    samples_for_goal: int
    comparisons: int  # the comparisons whose variance was pooled
    samples_per_subtask: float  # their median samples per subtask


def z_detect(alpha: float = ALPHA, power: float = POWER) -> float:
    """z(1 - alpha/2) + z(power): 2.80 for a two-sided 5% test with 80% power."""
    normal = NormalDist()
    return normal.inv_cdf(1 - alpha / 2) + normal.inv_cdf(power)


def detectable_difference(comparisons: Sequence[tuple[Any, ...]], goal: float = 5.0, *, alpha: float = ALPHA,
                          power: float = POWER) -> Detectable | None:
    """The smallest difference `comparisons` (each: paired differences, their subtasks, the subtasks' weights in
    the number or None for equal, and optionally their clusters, `sample_cluster`) can detect, and the samples
    per subtask that detect `goal` (module doc). With clusters, a problem's sampled responses are one sample, the
    mean of their differences, as the bootstrap resamples them. Only comparisons with two or more samples in
    every subtask count; None when none does or none varies (no variance to plan with)."""
    per_sample, squared_se, sizes = [], [], []
    for values, strata, weights, *rest in comparisons:
        clusters = rest[0] if rest else None
        if clusters is not None and len({str(c) for c in clusters}) < len(clusters):
            values, strata = cluster_means(values, strata, clusters)
        names, groups = _strata(values, strata)
        if not groups or any(len(g) < 2 for g in groups):
            continue
        w2 = _weights(names, weights) ** 2
        variances = np.asarray([np.var(g, ddof=1) for g in groups])
        per_sample.append(float(np.dot(w2, variances)))  # Var of the number with one pair per subtask
        squared_se.append(float(np.dot(w2, variances / [len(g) for g in groups])))
        sizes.append(float(np.median([len(g) for g in groups])))
    if not per_sample or max(per_sample) == 0:
        return None
    z = z_detect(alpha, power)
    variance = float(np.mean(per_sample))
    return Detectable(difference=z * math.sqrt(float(np.mean(squared_se))), goal=goal,
                      samples_for_goal=max(2, math.ceil(z**2 * variance / goal**2)), comparisons=len(per_sample),
                      samples_per_subtask=float(np.median(sizes)))
