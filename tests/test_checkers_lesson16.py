"""Lesson 16's checkers fail the obvious wrong answers and pass the reference solutions.

As in tests/test_checkers.py: on a real gloo cluster, the lesson's own checker cell runs after a wrong
solution (every rank must print "not yet") and after the lesson's reference solution (every rank "pass"). The
checkers need nothing from the lesson's earlier cells (the first tests a formula, the second builds its own
model and stages), so two ranks are enough.
"""

from __future__ import annotations

import pytest

from tests.test_checkers import assert_checker, assert_run_all, check

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


def test_16_a_closed_form_answer_passes(ip, cluster):
    """The float formula ceil((p-1)(1-t)/t) is right away from the boundary, where the checker asks (issue 41:
    at p = 4, t = 0.2 it said 13 and the checker, in floats, wanted 12)."""
    closed_form = """
import math


def microbatches_for_bubble(p, target):
    return max(1, math.ceil((p - 1) * (1 - target) / target))
"""
    assert set(check(ip, LESSON, 1, closed_form, WORLD).values()) == {"pass"}


# exercise 2: this rank's PipelineStage, its contiguous share of the blocks


def with_imports(answer: str) -> str:
    """An answer to exercise 2 with what it uses imported (the first one runs before any checker)."""
    return "\nfrom torch import nn\nfrom torch.distributed.pipelining import PipelineStage\n" + answer


STAGE_WRONG = {
    "the whole model as the stage": with_imports("""
def my_stage(model):
    return PipelineStage(model, rank, world_size, device)
"""),
    "the blocks dealt round-robin (rank, rank + world_size)": with_imports("""
def my_stage(model):
    return PipelineStage(nn.Sequential(*list(model)[rank::world_size]), rank, world_size, device)
"""),
    "one stage per block (num_stages = len(model))": with_imports("""
def my_stage(model):
    per_rank = len(model) // world_size
    blocks = nn.Sequential(*list(model)[rank * per_rank:(rank + 1) * per_rank])
    return PipelineStage(blocks, rank, len(model), device)
"""),
    "the stages numbered backwards": with_imports("""
def my_stage(model):
    per_rank = len(model) // world_size
    blocks = nn.Sequential(*list(model)[rank * per_rank:(rank + 1) * per_rank])
    return PipelineStage(blocks, world_size - 1 - rank, world_size, device)
"""),
    "the module, not a PipelineStage": with_imports("""
def my_stage(model):
    per_rank = len(model) // world_size
    return nn.Sequential(*list(model)[rank * per_rank:(rank + 1) * per_rank])
"""),
    "only the first block of the share": with_imports("""
def my_stage(model):
    per_rank = len(model) // world_size
    return PipelineStage(list(model)[rank * per_rank], rank, world_size, device)
"""),
}


@pytest.mark.parametrize("wrong", list(STAGE_WRONG))
def test_16_my_stage_must_be_this_ranks_contiguous_blocks(ip, cluster, wrong):
    assert_checker(ip, LESSON, 2, STAGE_WRONG[wrong], WORLD)


def test_16_run_all_checks_the_learners_answers(ip, cluster):
    wrong = {
        1: MICROBATCHES_WRONG["the bubble taken as (p-1)/m"],
        2: STAGE_WRONG["the blocks dealt round-robin (rank, rank + world_size)"],
    }
    assert_run_all(ip, LESSON, wrong, WORLD)
