"""kvbench.results.stats against known values: scipy's percentile bootstrap, an exact binomial bootstrap
distribution, a stratified case enumerated by hand, and the normal-approximation sample-size formula."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import scipy.stats as scipy_stats  # a test dependency (pyproject's [test]): the reference values

from kvbench.results.stats import (
    RESAMPLES,
    Estimate,
    bootstrap_interval,
    detectable_difference,
    estimate,
    frame_estimate,
    paired_estimate,
    sample_cluster,
    z_detect,
)


def test_one_subtask_is_scipys_percentile_bootstrap() -> None:
    values = [0.1, 0.4, 0.35, 0.2, 0.5, 0.0, 1.0]
    ours = bootstrap_interval(values, seed=7)
    theirs = scipy_stats.bootstrap((values,), np.mean, method="percentile", n_resamples=RESAMPLES,
                                   rng=np.random.default_rng(7)).confidence_interval
    assert ours == pytest.approx((theirs.low, theirs.high), abs=1e-12)
    assert bootstrap_interval(values, seed=7) == ours  # seeded: the same numbers every time


def test_a_paired_difference_is_scipys_paired_bootstrap() -> None:
    method = [1.0, 0.0, 1.0, 1.0, 0.2, 0.6, 1.0, 0.0]
    reference = [1.0, 1.0, 1.0, 0.0, 0.0, 0.6, 1.0, 1.0]
    ours = bootstrap_interval(np.subtract(method, reference), seed=3)
    theirs = scipy_stats.bootstrap((method, reference), lambda a, b, axis: a.mean(axis) - b.mean(axis),
                                   paired=True, method="percentile", n_resamples=RESAMPLES,
                                   rng=np.random.default_rng(3)).confidence_interval
    assert ours == pytest.approx((theirs.low, theirs.high), abs=1e-12)


def test_wins_and_ties_give_the_exact_binomial_percentiles() -> None:
    """20 shared samples, the method right where the reference is wrong on 6, alike on the rest: a resample's
    mean difference is Binomial(20, 0.3) / 20, whose 2.5% and 97.5% quantiles are 2/20 and 10/20 (the cdf
    jumps there, far from 0.025 and 0.975, so the Monte Carlo percentiles land on them)."""
    rows = [{"subtask": "niah", "sample_id": f"s{i}", "sample_digest": f"d{i}"} for i in range(20)]
    method = pd.DataFrame(rows).assign(score=[100.0] * 6 + [0.0] * 14)
    reference = pd.DataFrame(rows).assign(score=0.0)
    paired = paired_estimate(method, reference)
    low, high = (scipy_stats.binom.ppf(q, 20, 0.3) / 20 * 100 for q in (0.025, 0.975))
    assert (low, high) == (10.0, 50.0)
    assert paired == Estimate(30.0, 20, low, high) and paired.excludes_zero


def test_strata_are_resampled_apart_and_weigh_alike() -> None:
    """Subtask a always scores 1, b scores 0 and 1: b's resampled mean is 0, 0.5 or 1 with probabilities
    1/4, 1/2, 1/4, so the stratified mean (1 + b) / 2 has percentiles 0.5 and 1.0, around the printed 0.75
    (the mean of the subtask means, not the pooled 0.8)."""
    cell = estimate([1.0, 1.0, 1.0, 0.0, 1.0], ["a", "a", "a", "b", "b"])
    assert (cell.value, cell.n, cell.low, cell.high) == (0.75, 5, 0.5, 1.0)
    assert cell.text(2) == "0.75 [0.50, 1.00]"


def test_one_sample_has_no_interval_not_a_zero_width_one() -> None:
    assert estimate([1.0]) == Estimate(1.0, 1, None, None) and estimate([1.0]).text() == "1.0"
    lonely = estimate([1.0, 0.0, 1.0], ["a", "a", "b"])  # b's one sample has no spread to resample
    assert not lonely.has_interval and lonely.value == 0.75 and lonely.interval_text() == "-"
    assert estimate([0.0, 0.0, 0.0]).text() == "0.0 [0.0, 0.0]"  # observed alike: zero width, n > 1


def test_an_interval_depends_on_the_records_not_their_order() -> None:
    frame = pd.DataFrame({"subtask": list("aaabbb"), "sample_id": [f"x{i}" for i in range(6)],
                          "score": [90.0, 20.0, 55.0, 10.0, 70.0, 40.0]})
    assert frame_estimate(frame) == frame_estimate(frame.sample(frac=1.0, random_state=1))
    assert frame_estimate(frame.assign(score=None)) is None


def test_pairs_only_the_samples_both_points_ran_on_the_same_content() -> None:
    method = pd.DataFrame({"subtask": ["a", "a", "a", "b"], "sample_id": ["0", "1", "2", "0"],
                           "sample_digest": ["d0", "d1", "d2", "e0"], "score": [100.0, 0.0, 100.0, 50.0]})
    reference = pd.DataFrame({"subtask": ["a", "a", "b"], "sample_id": ["0", "1", "0"],
                              "sample_digest": ["d0", "d1-regenerated", "e0"], "score": [0.0, 0.0, 50.0]})
    paired = paired_estimate(method, reference)  # a/0 and b/0: a/1's prompt differs, a/2 is the method's alone
    assert (paired.value, paired.n, paired.has_interval) == (50.0, 2, False)
    assert paired_estimate(method, reference.assign(sample_id="other")) is None


def test_detectable_difference_by_hand() -> None:
    """Differences 0, 10, 0, 10: variance 100/3, SE sqrt(100/3 / 4); the detectable difference 2.80 SE and
    the samples for 5 points ceil(2.80^2 (100/3) / 25)."""
    z = scipy_stats.norm.ppf(0.975) + scipy_stats.norm.ppf(0.80)
    assert z_detect() == pytest.approx(z, abs=1e-9) and round(z, 2) == 2.80
    found = detectable_difference([([0.0, 10.0, 0.0, 10.0], ["a"] * 4, None)])
    assert found.difference == pytest.approx(z * math.sqrt(100 / 3 / 4))
    assert found.samples_for_goal == math.ceil(z**2 * (100 / 3) / 25) == 11
    # two subtasks: the variance of a mean of two subtask means is a quarter of the sum; a comparison with a
    # lone sample in a subtask has no variance to pool, an identical pair pools a zero
    two = detectable_difference([([0.0, 10.0, 0.0, 10.0, 5.0, 5.0], list("aaaabb"), None),
                                 ([1.0, 2.0], list("ab"), None), ([0.0, 0.0], list("aa"), None)])
    assert two.comparisons == 2
    assert two.difference == pytest.approx(z * math.sqrt((100 / 3 / 4 / 4 + 0) / 2))
    assert detectable_difference([([3.0, 3.0], ["a", "a"], None)]) is None  # nothing varies: nothing to plan with
    # weights: a subtask weighing 3/4 carries (3/4)^2 of its variance into the number's
    weighted = detectable_difference([([0.0, 10.0, 0.0, 10.0, 5.0, 5.0], list("aaaabb"), {"a": 3, "b": 1})])
    assert weighted.difference == pytest.approx(z * math.sqrt(0.75**2 * 100 / 3 / 4))


def test_sampled_responses_to_one_problem_are_resampled_together() -> None:
    """Math-500's protocol: five sampled responses per problem. A problem's responses share its difficulty, so
    the bootstrap draws problems (each as the mean of its responses), not responses: with every problem's
    responses alike, the interval is the one over the problems' single scores, wider than the one that would
    count each response as a problem. The printed mean stays the mean over responses."""
    problems = [100.0, 0.0, 100.0, 0.0, 0.0, 100.0, 100.0, 100.0]
    values = [score for score in problems for _ in range(5)]
    meta = [{"unique_id": f"p{i}", "samples_per_problem": 5} for i in range(len(problems)) for _ in range(5)]
    clusters = [sample_cluster(f"math500/p{i // 5}/{i % 5}", m) for i, m in enumerate(meta)]
    assert len(set(clusters)) == len(problems)
    by_problem = estimate(values, clusters=clusters)
    assert by_problem.value == pytest.approx(62.5) and by_problem.n == 40
    assert (by_problem.low, by_problem.high) == bootstrap_interval(problems)
    responses = bootstrap_interval(values)
    assert by_problem.high - by_problem.low > 1.5 * (responses[1] - responses[0])
    # one response per problem (greedy points), or a task without problems: every sample its own cluster
    assert sample_cluster("math500/p0/0", {"unique_id": "p0", "samples_per_problem": 1}) == "sample:math500/p0/0"
    assert sample_cluster("niah/3", {"depth": 0.5}) == "sample:niah/3"


def test_reports_and_summaries_resample_problems_where_records_are_responses(tmp_path) -> None:
    from kvbench.results.summary import summarize

    records = [{"task": "math500", "sample_id": f"math500/p{p}/{k}", "score": float((p * 7 + k) % 3 == 0),
                "meta": {"unique_id": f"p{p}", "samples_per_problem": 4}} for p in range(6) for k in range(4)]
    clusters = [sample_cluster(r["sample_id"], r["meta"]) for r in records]
    values = [100.0 * r["score"] for r in records]
    expected = bootstrap_interval(values, ["math500"] * len(values), clusters=clusters)
    assert summarize(records)["score_ci"] == pytest.approx(list(expected))
    frame = pd.DataFrame({"subtask": "math500", "sample_id": [r["sample_id"] for r in records],
                          "score": values, "cluster": clusters})
    found = frame_estimate(frame)
    assert (found.low, found.high) == expected and found.n == 24
    # a frame whose clusters are its samples is the plain bootstrap, bitwise
    plain = frame.assign(cluster=[f"sample:{s}" for s in frame["sample_id"]])
    assert frame_estimate(plain) == frame_estimate(plain.drop(columns="cluster"))
    paired = paired_estimate(frame, frame.assign(score=0.0))
    assert (paired.low, paired.high) == expected
