"""Lesson 13's checkers fail the obvious wrong answers and pass the reference solutions.

As in tests/test_checkers.py: on a real gloo cluster of 3 ranks (the lesson's exercises run after its
``%dist_recover --shrink`` left three), with the lesson's training job defined on every rank, the lesson's own
checker cell runs after a wrong solution (every rank must print ``fail``) and after the lesson's reference
solution (every rank ``pass``).
"""

from __future__ import annotations

import pytest

from tests.checker_harness import assert_checker, assert_run_all, lesson_cell, on_ranks
from tests.conftest import running_cluster

LESSON = "13_fault_tolerance"
WORLD = 3


@pytest.fixture(scope="module")
def lesson_ranks(ip):
    """3 ranks holding the lesson's job (``X``, ``nn``, ``shard``, ``model``, ...), run from its
    ``%%writefile`` cell's code."""
    with running_cluster(ip, WORLD) as magics:
        job = lesson_cell(LESSON, '"""Lesson 13\'s training job')
        assert job.startswith("%%writefile job13.py\n")
        on_ranks(ip, job.partition("\n")[2])
        yield magics


# exercise 1: every parameter and buffer from rank src

RESYNC_WRONG = {
    "always from rank 0": """
def resync(model, src):
    for tensor in model.state_dict().values():
        dist.broadcast(tensor, src=0)
""",
    "parameters only (BatchNorm's running statistics and counter stay)": """
def resync(model, src):
    with torch.no_grad():
        for p in model.parameters():
            dist.broadcast(p, src=src)
""",
    "the mean of the ranks, not rank src's values": """
def resync(model, src):
    for tensor in model.state_dict().values():
        if tensor.is_floating_point():
            dist.all_reduce(tensor)
            tensor /= world_size
""",
    "nothing sent (each rank keeps its own)": """
def resync(model, src):
    dist.barrier()
""",
}


@pytest.mark.parametrize("wrong", list(RESYNC_WRONG))
def test_13_resync_must_copy_every_tensor_from_src(ip, lesson_ranks, wrong):
    assert_checker(ip, LESSON, 1, RESYNC_WRONG[wrong], WORLD)


# exercise 2: contiguous, covering, balanced shards

SHARD_WRONG = {
    "the remainder dropped (gaps)": """
def shard_after_shrink(n_items, rank, world_size):
    size = n_items // world_size
    return range(rank * size, (rank + 1) * size)
""",
    "ceil-sized blocks (the last rank short by more than one, or past the end)": """
import math


def shard_after_shrink(n_items, rank, world_size):
    size = math.ceil(n_items / world_size)
    return range(rank * size, min((rank + 1) * size, n_items))
""",
    "overlapping blocks": """
def shard_after_shrink(n_items, rank, world_size):
    base, extra = divmod(n_items, world_size)
    start = rank * base
    return range(start, min(start + base + 1, n_items))
""",
    "strided, not contiguous": """
def shard_after_shrink(n_items, rank, world_size):
    return range(rank, n_items, world_size)
""",
}


@pytest.mark.parametrize("wrong", list(SHARD_WRONG))
def test_13_shards_must_cover_each_item_once_in_blocks(ip, lesson_ranks, wrong):
    assert_checker(ip, LESSON, 2, SHARD_WRONG[wrong], WORLD)


def test_13_run_all_checks_the_learners_answers(ip, lesson_ranks):
    wrong = {
        1: RESYNC_WRONG["parameters only (BatchNorm's running statistics and counter stay)"],
        2: SHARD_WRONG["the remainder dropped (gaps)"],
    }
    assert_run_all(ip, LESSON, wrong, WORLD)
