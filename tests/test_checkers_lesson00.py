"""Lesson 00's exercise checkers refuse wrong answers and pass the reference solutions
(tests/checker_harness.py says how)."""

from __future__ import annotations

import pytest

from tests.checker_harness import assert_checker, assert_run_all

# lesson 00: one all_reduce, not a value by hand


COUNT_WRONG = {
    "value by hand": """
def count_ranks():
    return torch.ones(1) * world_size  # the right value, no communication
""",
    "all_reduce of another tensor": """
def count_ranks():
    dist.all_reduce(torch.ones(1))
    return torch.ones(1) * world_size  # still written in by hand
""",
}


@pytest.mark.parametrize("wrong", list(COUNT_WRONG))
def test_00_count_ranks_must_all_reduce(ip, cluster, wrong):
    assert_checker(ip, "00_start_here", 2, COUNT_WRONG[wrong], 2)


def test_00_run_all_checks_the_learners_answers(ip, cluster):
    three = "mine = torch.full((3,), float(rank ** 2))  # three elements, not four"
    wrong = {1: three, 2: COUNT_WRONG["value by hand"]}
    assert_run_all(ip, "00_start_here", wrong, 2)
