"""What a run says about its own length: the sample count and why, then time per sample and time left."""

from __future__ import annotations

import logging

from kvbench.run.progress import SampleProgress, SweepEstimate, duration, sample_count
from kvbench.tasks.base import Sample, Turn


def samples(subtasks: int, per: int) -> list[Sample]:
    return [Sample(id=f"{t}-{i}", task=f"ruler_t{t}", context="c", turns=[Turn(question="q", answers=["a"], max_new_tokens=4,
                                                                                metric="string_match_all")])
            for t in range(subtasks) for i in range(per)]


def test_a_suite_says_its_count_is_per_subtask():
    assert sample_count(samples(11, 5), 5) == "55 samples (task.num_samples=5 per subtask x 11 subtasks)"
    assert sample_count(samples(1, 5), 5) == "5 samples"


def test_after_the_first_sample_the_time_left_is_logged_once(caplog):
    bar = SampleProgress(4, "snapkv b=64 ruler_4k", enabled=False)
    with caplog.at_level(logging.INFO, logger="kvbench"):
        bar.update()
        bar.update()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith("snapkv b=64 ruler_4k: ") and "left for the other 3" in lines[0]


def test_a_sweep_estimates_its_remaining_groups(caplog):
    estimate = SweepEstimate(3)
    with caplog.at_level(logging.INFO, logger="kvbench"):
        estimate.group_done()
        estimate.group_done()
        estimate.group_done()
    lines = [r.getMessage() for r in caplog.records]
    assert [line.split(";")[0] for line in lines] == ["sweep: 1 of 3 groups of points done",
                                                      "sweep: 2 of 3 groups of points done"]


def test_durations_read_naturally():
    assert [duration(s) for s in (42, 450, 11520)] == ["42 s", "7.5 min", "3.2 h"]
