"""Lesson 14's checkers fail the obvious wrong answers and pass the reference solutions.

As in tests/test_checkers.py: on a real gloo cluster of 2 ranks, with the lesson's set-up cell run on every
rank (``make_model``, ``local_bytes``, ``fully_shard``, ``FSDPModule``, ``DTensor``), and the lesson's
``shard_per_block`` (one wrong answer of exercise 2 is that function), the lesson's own checker
cell runs after a wrong solution (every rank must print ``not yet``) and after the lesson's reference solution
(every rank ``pass``).
"""

from __future__ import annotations

import pytest

from tests.checker_harness import assert_checker, assert_run_all, check, lesson_cell, on_ranks
from tests.conftest import running_cluster

LESSON = "14_fsdp"
WORLD = 2


@pytest.fixture(scope="module")
def lesson_ranks(ip):
    """2 ranks holding the lesson's set-up: its imports, ``make_model`` and ``local_bytes``."""
    with running_cluster(ip, WORLD) as magics:
        on_ranks(ip, lesson_cell(LESSON, '"""Lesson 14\'s set-up'))
        on_ranks(ip, lesson_cell(LESSON, "def shard_per_block(model, **options):"))
        yield magics


# exercise 1: the bytes of a group's all-gather, every rank's piece padded to rank 0's torch.chunk size

PREDICT_WRONG = {
    "the parameters' own bytes (no padding)": """
def gathered_bytes(model, world_size):
    return sum(p.nbytes for p in model.parameters())
""",
    "padded per group, not per parameter": """
import math


def gathered_bytes(model, world_size):
    elements = sum(p.numel() for p in model.parameters())
    return world_size * math.ceil(elements / world_size) * 4
""",
    "floor-sized pieces (the remainder's rows dropped)": """
def gathered_bytes(model, world_size):
    return world_size * sum(p.shape[0] // world_size * (p.numel() // p.shape[0]) * p.element_size()
                            for p in model.parameters())
""",
    "this rank's own shard only": """
import math


def gathered_bytes(model, world_size):
    return sum(math.ceil(p.shape[0] / world_size) * (p.numel() // p.shape[0]) * p.element_size()
               for p in model.parameters())
""",
}


@pytest.mark.parametrize("wrong", list(PREDICT_WRONG))
def test_14_gathered_bytes_must_follow_fully_shard(ip, lesson_ranks, wrong):
    assert_checker(ip, LESSON, 1, PREDICT_WRONG[wrong], WORLD)


# exercise 2: a group per block but the last; the last block and the head in one group, kept after forward

SHARD_WRONG = {
    "every block resharded, the head in the root's group (the lesson's shard_per_block)": """
def shard_keep_last(model):
    return shard_per_block(model)
""",
    "the last block kept in a group of its own, the head in the root's group": """
def shard_keep_last(model):
    blocks = list(model)[:-1]
    for i, block in enumerate(blocks):
        fully_shard(block, mesh=mesh, reshard_after_forward=i < len(blocks) - 1)
    fully_shard(model, mesh=mesh)
    return model
""",
    "the last block and the head in one group, but resharded after forward": """
def shard_keep_last(model):
    *blocks, last, head = model
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard([last, head], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model
""",
    "the last block and the head kept, but as two groups": """
def shard_keep_last(model):
    *blocks, last, head = model
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(last, mesh=mesh, reshard_after_forward=False)
    fully_shard(head, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh)
    return model
""",
    "every group kept after forward": """
def shard_keep_last(model):
    *blocks, last, head = model
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=False)
    fully_shard([last, head], mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh)
    return model
""",
    "the whole model only (one group)": """
def shard_keep_last(model):
    fully_shard(model, mesh=mesh)
    return model
""",
    "no root (each group its own root)": """
def shard_keep_last(model):
    *blocks, last, head = model
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard([last, head], mesh=mesh, reshard_after_forward=False)
    return model
""",
    "top-down (the root first)": """
def shard_keep_last(model):
    fully_shard(model, mesh=mesh)
    *blocks, last, head = model
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard([last, head], mesh=mesh, reshard_after_forward=False)
    return model
""",
    "two blocks in one group": """
def shard_keep_last(model):
    fully_shard([model[0], model[1]], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard([model[3], model[4]], mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh)
    return model
""",
}


@pytest.mark.parametrize("wrong", list(SHARD_WRONG))
def test_14_shard_keep_last_must_group_the_last_block_with_the_head_and_keep_it(ip, lesson_ranks, wrong):
    assert_checker(ip, LESSON, 2, SHARD_WRONG[wrong], WORLD)


def test_14_gathered_bytes_by_chunking_passes(ip, lesson_ranks):
    """Another right method: chunk an empty tensor of each parameter's shape, as fully_shard does, and count
    rank 0's (the largest) chunk once per rank."""
    by_chunk = """
def gathered_bytes(model, world_size):
    total = 0
    for p in model.parameters():
        first = torch.chunk(torch.empty(p.shape, dtype=p.dtype, device="meta"), world_size)[0]
        total += first.numel() * p.element_size()
    return total * world_size
"""
    assert set(check(ip, LESSON, 1, by_chunk, WORLD).values()) == {"pass"}


def test_14_shard_keep_last_set_after_sharding_passes(ip, lesson_ranks):
    """Another right method: the shared group made with the default, then kept gathered after forward."""
    set_afterwards = """
def shard_keep_last(model):
    *blocks, last, head = model
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard([last, head], mesh=mesh)
    last.set_reshard_after_forward(False)
    return fully_shard(model, mesh=mesh)
"""
    assert set(check(ip, LESSON, 2, set_afterwards, WORLD).values()) == {"pass"}


def test_14_run_all_checks_the_learners_answers(ip, lesson_ranks):
    wrong = {
        1: PREDICT_WRONG["the parameters' own bytes (no padding)"],
        2: SHARD_WRONG["every block resharded, the head in the root's group (the lesson's shard_per_block)"],
    }
    assert_run_all(ip, LESSON, wrong, WORLD)
