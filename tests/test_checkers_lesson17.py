"""Lesson 17's checkers fail the obvious wrong answers and pass the reference solutions.

As in tests/test_checkers.py: on a real gloo cluster of 2 ranks, with the lesson's set-up cell run on every
rank (``attend``, ``NEG_INF``, the sequence), the lesson's own checker cell runs after a wrong solution (every
rank must print ``not yet``) and after the lesson's reference solution (every rank ``pass``).
"""

from __future__ import annotations

import pytest

from tests.conftest import running_cluster
from tests.test_checkers import assert_checker, assert_run_all, lesson_cell, on_ranks

LESSON = "17_context_parallel"
WORLD = 2


@pytest.fixture(scope="module")
def lesson_ranks(ip):
    """2 ranks holding the lesson's set-up: ``attend`` and ``NEG_INF``."""
    with running_cluster(ip, WORLD) as magics:
        on_ranks(ip, lesson_cell(LESSON, '"""Lesson 17\'s set-up'))
        yield magics


# exercise 1: the log-sum-exp merge of two blocks' attention

MERGE_WRONG = {
    "the mean of the two outputs": """
def merge_blocks(out_a, lse_a, out_b, lse_b):
    return (out_a + out_b) / 2, torch.logaddexp(lse_a, lse_b)
""",
    "weights exp(lse) without normalising": """
def merge_blocks(out_a, lse_a, out_b, lse_b):
    return torch.exp(lse_a) * out_a + torch.exp(lse_b) * out_b, torch.logaddexp(lse_a, lse_b)
""",
    "the larger lse instead of logaddexp": """
def merge_blocks(out_a, lse_a, out_b, lse_b):
    lse = torch.maximum(lse_a, lse_b)
    return torch.exp(lse_a - lse) * out_a + torch.exp(lse_b - lse) * out_b, lse
""",
    "right for visible keys, NaN where a block is empty": """
def merge_blocks(out_a, lse_a, out_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)
    return torch.exp(lse_a - lse) * out_a + torch.exp(lse_b - lse) * out_b, lse
""",
    "the weights swapped": """
def merge_blocks(out_a, lse_a, out_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(lse == float("-inf"), 0.0, lse)
    return torch.exp(lse_b - safe) * out_a + torch.exp(lse_a - safe) * out_b, lse
""",
}


@pytest.mark.parametrize("wrong", list(MERGE_WRONG))
def test_17_merge_must_follow_the_log_sum_exp_rule(ip, lesson_ranks, wrong):
    assert_checker(ip, LESSON, 1, MERGE_WRONG[wrong], WORLD)


# exercise 2: head-tail positions

ZIGZAG_WRONG = {
    "a plain contiguous split": """
def zigzag(rank, world_size, seq_len):
    per_rank = seq_len // world_size
    return list(range(rank * per_rank, (rank + 1) * per_rank))
""",
    "round-robin striping": """
def zigzag(rank, world_size, seq_len):
    return list(range(rank, seq_len, world_size))
""",
    "the tail chunk from the wrong end (chunk P + rank)": """
def zigzag(rank, world_size, seq_len):
    chunk = seq_len // (2 * world_size)
    head = list(range(rank * chunk, (rank + 1) * chunk))
    tail = list(range((world_size + rank) * chunk, (world_size + rank + 1) * chunk))
    return head + tail
""",
    "tensors, not lists": """
def zigzag(rank, world_size, seq_len):
    chunk = seq_len // (2 * world_size)
    head = torch.arange(rank * chunk, (rank + 1) * chunk)
    tail = torch.arange((2 * world_size - 1 - rank) * chunk, (2 * world_size - rank) * chunk)
    return torch.cat([head, tail])
""",
    "the tail first": """
def zigzag(rank, world_size, seq_len):
    chunk = seq_len // (2 * world_size)
    tail = list(range((2 * world_size - 1 - rank) * chunk, (2 * world_size - rank) * chunk))
    return tail + list(range(rank * chunk, (rank + 1) * chunk))
""",
}


@pytest.mark.parametrize("wrong", list(ZIGZAG_WRONG))
def test_17_zigzag_must_balance_the_causal_work(ip, lesson_ranks, wrong):
    assert_checker(ip, LESSON, 2, ZIGZAG_WRONG[wrong], WORLD)


def test_17_run_all_checks_the_learners_answers(ip, lesson_ranks):
    wrong = {
        1: MERGE_WRONG["the mean of the two outputs"],
        2: ZIGZAG_WRONG["round-robin striping"],
    }
    assert_run_all(ip, LESSON, wrong, WORLD)
