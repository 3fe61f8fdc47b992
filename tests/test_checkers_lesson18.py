"""Lesson 18's checkers fail the obvious wrong answers and pass the reference solutions.

As in tests/test_checkers.py: on a real gloo cluster of 2 ranks, the lesson's own checker cell runs after a
wrong solution (every rank must print ``not yet``) and after the lesson's reference solution (every rank
``pass``). The checkers test pure functions of expert indices, so nothing of the lesson's set-up is needed.
"""

from __future__ import annotations

import pytest

from tests.test_checkers import assert_checker, assert_run_all

LESSON = "18_expert_parallel"
WORLD = 2

# exercise 1: rows per destination rank

SPLIT_WRONG = {
    "rows per expert, not per rank": """
def split_sizes(expert_ids, experts_per_rank, world_size):
    return torch.bincount(expert_ids, minlength=experts_per_rank * world_size).tolist()
""",
    "experts dealt round-robin (expert % world_size)": """
def split_sizes(expert_ids, experts_per_rank, world_size):
    return torch.bincount(expert_ids % world_size, minlength=world_size).tolist()
""",
    "an even split of the rows": """
def split_sizes(expert_ids, experts_per_rank, world_size):
    return [len(expert_ids) // world_size] * world_size
""",
    "ranks without rows left out": """
def split_sizes(expert_ids, experts_per_rank, world_size):
    return torch.bincount(expert_ids // experts_per_rank).tolist()
""",
    "a tensor, not a list": """
def split_sizes(expert_ids, experts_per_rank, world_size):
    return torch.bincount(expert_ids // experts_per_rank, minlength=world_size)
""",
}


@pytest.mark.parametrize("wrong", list(SPLIT_WRONG))
def test_18_split_sizes_must_count_rows_per_rank(ip, cluster, wrong):
    assert_checker(ip, LESSON, 1, SPLIT_WRONG[wrong], WORLD)


# exercise 2: each expert keeps its first `capacity` rows in token order

CAPACITY_WRONG = {
    "the first `capacity` rows overall": """
def within_capacity(expert_ids, capacity):
    return torch.arange(len(expert_ids)) < capacity
""",
    "the last rows of each expert kept": """
def within_capacity(expert_ids, capacity):
    flipped = expert_ids.flip(0)
    seen, keep = {}, []
    for e in flipped.tolist():
        seen[e] = seen.get(e, 0) + 1
        keep.append(seen[e] <= capacity)
    return torch.tensor(keep).flip(0)
""",
    "off by one (capacity + 1 kept)": """
def within_capacity(expert_ids, capacity):
    seen, keep = {}, []
    for e in expert_ids.tolist():
        seen[e] = seen.get(e, 0) + 1
        keep.append(seen[e] <= capacity + 1)
    return torch.tensor(keep, dtype=torch.bool)
""",
    "nothing dropped": """
def within_capacity(expert_ids, capacity):
    return torch.ones(len(expert_ids), dtype=torch.bool)
""",
}


@pytest.mark.parametrize("wrong", list(CAPACITY_WRONG))
def test_18_capacity_must_keep_each_experts_first_rows(ip, cluster, wrong):
    assert_checker(ip, LESSON, 2, CAPACITY_WRONG[wrong], WORLD)


def test_18_run_all_checks_the_learners_answers(ip, cluster):
    wrong = {
        1: SPLIT_WRONG["experts dealt round-robin (expert % world_size)"],
        2: CAPACITY_WRONG["the first `capacity` rows overall"],
    }
    assert_run_all(ip, LESSON, wrong, WORLD)
