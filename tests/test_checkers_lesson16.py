"""Lesson 16's checkers fail the obvious wrong answers and pass the reference solutions.

As in tests/test_checkers.py: on a real gloo cluster, the lesson's own checker cell runs after a wrong
solution (every rank must print "not yet") and after the lesson's reference solution (every rank "pass"). The
checkers need nothing from the lesson's earlier cells (they test formulas against their own play of the
schedules), so two ranks are enough.
"""

from __future__ import annotations

import pytest

from tests.test_checkers import assert_checker, assert_run_all

LESSON = "16_pipeline_parallel"
WORLD = 2

# exercise 1: the smallest number of micro-batches whose bubble (p-1)/(m+p-1) is at most the target

MICROBATCHES_WRONG = {
    "one micro-batch per stage (m = p)": """
def microbatches_for_bubble(p, target):
    return p
""",
    "the bubble taken as (p-1)/m": """
import math


def microbatches_for_bubble(p, target):
    return max(1, math.ceil((p - 1) / target))
""",
    "rounded to the nearest, not up": """
def microbatches_for_bubble(p, target):
    return max(1, round((p - 1) / target - (p - 1)))
""",
    "one more than needed": """
def microbatches_for_bubble(p, target):
    m = 1
    while (p - 1) / (m + p - 1) > target:
        m += 1
    return m + 1
""",
    "a float, not a count": """
def microbatches_for_bubble(p, target):
    return max(1.0, (p - 1) / target - (p - 1))
""",
}


@pytest.mark.parametrize("wrong", list(MICROBATCHES_WRONG))
def test_16_microbatches_must_be_the_smallest_under_the_target(ip, cluster, wrong):
    assert_checker(ip, LESSON, 1, MICROBATCHES_WRONG[wrong], WORLD)


# exercise 2: micro-batches whose activations a stage holds at its peak

PEAK_WRONG = {
    "1F1B holds p on every stage": """
def peak_microbatches(schedule, p, m, stage):
    return m if schedule == "GPipe" else p
""",
    "1F1B off by one (p - stage - 1)": """
def peak_microbatches(schedule, p, m, stage):
    return m if schedule == "GPipe" else max(1, p - stage - 1)
""",
    "GPipe treated like 1F1B": """
def peak_microbatches(schedule, p, m, stage):
    return min(m, p - stage)
""",
    "1F1B counted from the last stage (stage + 1)": """
def peak_microbatches(schedule, p, m, stage):
    return m if schedule == "GPipe" else stage + 1
""",
    "every schedule holds all m": """
def peak_microbatches(schedule, p, m, stage):
    return m
""",
}


@pytest.mark.parametrize("wrong", list(PEAK_WRONG))
def test_16_peak_must_follow_each_schedule(ip, cluster, wrong):
    assert_checker(ip, LESSON, 2, PEAK_WRONG[wrong], WORLD)


def test_16_run_all_checks_the_learners_answers(ip, cluster):
    wrong = {
        1: MICROBATCHES_WRONG["the bubble taken as (p-1)/m"],
        2: PEAK_WRONG["1F1B holds p on every stage"],
    }
    assert_run_all(ip, LESSON, wrong, WORLD)
