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


def _correlated_responses(problems: int, responses: int, seed: int, spread: float) -> np.ndarray:
    """[problems, responses] of 0/100 scores: each problem's chance of a right response drawn from Beta(spread,
    spread) (small spread: problems the model nearly always or nearly never gets, so a problem's responses agree),
    its responses Bernoulli draws with that chance. spread=None: one chance for every problem, independent
    responses."""
    rng = np.random.default_rng(seed)
    chance = rng.beta(spread, spread, size=problems) if spread is not None else np.full(problems, 0.5)
    return 100.0 * (rng.random((problems, responses)) < chance[:, None])


def _direct_problem_bootstrap(subtasks: dict[str, np.ndarray], seed: int) -> tuple[float, float]:
    """The problem-level bootstrap written out: per resample and subtask (sorted), as many problems drawn with
    replacement as the subtask has (indices into its problems in the order of their sample ids, as a report
    sorts records), each with its responses; the number is the mean over subtasks of the mean of the drawn
    problems' mean scores; the 95% interval the 2.5th and 97.5th percentiles."""
    rng = np.random.default_rng(seed)
    numbers = np.zeros(RESAMPLES)
    for name in sorted(subtasks):
        scores = subtasks[name]  # [problems, responses]
        drawn = rng.integers(0, len(scores), size=(RESAMPLES, len(scores)))  # problem indices
        numbers += scores[drawn].mean(axis=(1, 2)) / len(subtasks)  # [resamples, problems, responses]
    low, high = np.percentile(numbers, [2.5, 97.5])
    return float(low), float(high)


def _as_records(subtasks: dict[str, np.ndarray]) -> pd.DataFrame:
    """The scores as `kvbench.results.load` gives Math-500's records: one row per response, its problem in the
    record's meta (`unique_id`, `samples_per_problem`), so its `cluster`, in the order collect reads them."""
    rows = []
    for name, scores in subtasks.items():
        for p, responses in enumerate(scores):
            meta = {"unique_id": f"{name}/p{p:03d}", "samples_per_problem": len(responses)}
            for k, score in enumerate(responses):
                sample_id = f"math500/{name}/p{p:03d}/{k}"
                rows.append({"subtask": name, "sample_id": sample_id, "score": score,
                             "cluster": sample_cluster(sample_id, meta)})
    return pd.DataFrame(rows).sample(frac=1.0, random_state=3)  # records in no particular order


def test_the_interval_of_sampled_responses_is_the_direct_problem_level_bootstrap() -> None:
    """Issue 65: Math-500's five responses per problem. A report's interval (`frame_estimate` over records as
    `kvbench.results.load` gives them) equals, on a fixed seed, the problem-level bootstrap written out directly
    (problems drawn within each subtask, each carrying its responses), and scipy's percentile bootstrap over the
    problems' means for one subtask. On correlated responses the response-level bootstrap, which treats every
    response as a problem of its own, is far narrower; on independent responses the two agree, so the
    difference is the correlation's, not the problem-level bootstrap's own width."""
    subtasks = {"algebra": _correlated_responses(12, 5, seed=1, spread=0.3),
                "geometry": _correlated_responses(9, 5, seed=2, spread=0.3)}
    frame = _as_records(subtasks)
    found = frame_estimate(frame)
    assert found.n == 21 * 5 and found.value == pytest.approx(np.mean([s.mean() for s in subtasks.values()]))
    assert (found.low, found.high) == pytest.approx(_direct_problem_bootstrap(subtasks, seed=0), abs=1e-9)
    one = {"algebra": subtasks["algebra"]}
    theirs = scipy_stats.bootstrap((one["algebra"].mean(axis=1),), np.mean, method="percentile",
                                   n_resamples=RESAMPLES, rng=np.random.default_rng(0)).confidence_interval
    alone = frame_estimate(frame[frame["subtask"] == "algebra"])
    assert (alone.low, alone.high) == pytest.approx(_direct_problem_bootstrap(one, seed=0), abs=1e-9)
    assert (alone.low, alone.high) == pytest.approx((theirs.low, theirs.high), abs=1e-9)
    # the responses resampled one by one (no clusters): the interval issue 65 found, far too narrow
    by_response = frame_estimate(frame.drop(columns="cluster"))
    width, response_width = found.high - found.low, by_response.high - by_response.low
    assert response_width < 0.7 * width, (width, response_width)
    # independent responses (one chance for every problem): no correlation, about the same width
    independent = {"algebra": _correlated_responses(200, 5, seed=4, spread=None),
                   "geometry": _correlated_responses(200, 5, seed=5, spread=None)}
    frame = _as_records(independent)
    problems, responses = frame_estimate(frame), frame_estimate(frame.drop(columns="cluster"))
    assert 0.85 < (responses.high - responses.low) / (problems.high - problems.low) < 1.15
    assert (problems.low, problems.high) == pytest.approx(_direct_problem_bootstrap(independent, seed=0), abs=1e-9)


def test_reports_name_the_unit_their_intervals_resampled() -> None:
    from kvbench.reporting.uncertainty import detectable_text
    from kvbench.results.stats import frame_resampled_unit, resampled_unit

    frame = _as_records({"algebra": _correlated_responses(4, 5, seed=1, spread=0.3)})
    unit = "problems (each with its 5 sampled responses; n counts responses)"
    assert frame_resampled_unit(frame) == unit
    # two points' records of the same problems: a problem's responses are its distinct sample ids
    assert frame_resampled_unit(pd.concat([frame, frame])) == unit
    assert frame_resampled_unit(frame.drop(columns="cluster")) == "samples"
    lone = [sample_cluster(f"niah/{i}", {}) for i in range(3)]
    assert resampled_unit(lone, [f"niah/{i}" for i in range(3)]) == "samples"
    mixed = resampled_unit([*frame["cluster"], *lone], [*frame["sample_id"], "a", "b", "c"])
    assert mixed == unit + ", samples elsewhere"
    # a problem with a response missing (an interrupted run): the range of counts
    assert resampled_unit(frame["cluster"][1:], frame["sample_id"][1:]).startswith("problems (each with its 4-5 ")
    # the detectable difference counts problems where the intervals do
    found = detectable_difference([([0.0, 10.0, 0.0, 10.0], ["a"] * 4, None)])
    assert "median 4 samples per subtask" in detectable_text(found, "x")
    assert "median 4 problems per subtask" in detectable_text(found, "x", unit)


def test_the_detectable_difference_of_sampled_responses_counts_problems() -> None:
    """The planning numbers take the bootstrap's unit: a problem's responses are one sample, the mean of their
    paired differences, so 2 problems of 5 identical responses are 2 samples, not 10, and the task.num_samples
    it asks for are problems (Math-500's num_samples)."""
    problems = [0.0, 10.0, 0.0, 10.0]
    values = [v for v in problems for _ in range(5)]
    clusters = [f"problem:p{i // 5}" for i in range(len(values))]
    by_problem = detectable_difference([(values, ["a"] * len(values), None, clusters)])
    assert by_problem == detectable_difference([(problems, ["a"] * 4, None)])
    assert by_problem.samples_per_subtask == 4
    by_response = detectable_difference([(values, ["a"] * len(values), None)])
    assert by_response.difference < by_problem.difference / 2  # 20 "samples": the too optimistic planning
    lone = [f"sample:{i}" for i in range(4)]  # clusters of one: as without clusters
    assert detectable_difference([(problems, ["a"] * 4, None, lone)]) == by_problem
