"""Lesson 16's checkers fail the obvious wrong answers and pass the reference solutions.

As in tests/test_checkers.py: on a real gloo cluster, the lesson's own checker cell runs after a wrong
solution (every rank must print "not yet") and after the lesson's reference solution (every rank "pass"). The
checkers need nothing from the lesson's earlier cells (each builds its own model and stages: the first runs
``Schedule1F1B`` to compare its order with the prediction), so two ranks are enough.
"""

from __future__ import annotations

import pytest

from tests.checker_harness import assert_checker, assert_run_all, check

LESSON = "16_pipeline_parallel"
WORLD = 2

# exercise 1: the order of a stage's forwards and backwards under Schedule1F1B, for any m

ORDER_WRONG = {
    "GPipe's order (all forwards, then all backwards)": """
def order_1f1b(p, s, m):
    return " ".join([f"F{i}" for i in range(m)] + [f"B{i}" for i in range(m)])
""",
    "a warm-up of p - s - 1 forwards": """
def order_1f1b(p, s, m):
    warmup = max(1, p - s - 1)
    words = [f"F{i}" for i in range(warmup)]
    for i in range(m - warmup):
        words += [f"B{i}", f"F{warmup + i}"]
    return " ".join(words + [f"B{i}" for i in range(m - warmup, m)])
""",
    "the stages reversed (a warm-up of s + 1 forwards)": """
def order_1f1b(p, s, m):
    warmup = s + 1
    words = [f"F{i}" for i in range(warmup)]
    for i in range(m - warmup):
        words += [f"B{i}", f"F{warmup + i}"]
    return " ".join(words + [f"B{i}" for i in range(m - warmup, m)])
""",
    "one forward, then one backward, after the warm-up": """
def order_1f1b(p, s, m):
    warmup = p - s
    words = [f"F{i}" for i in range(warmup)]
    for i in range(m - warmup):
        words += [f"F{warmup + i}", f"B{i}"]
    return " ".join(words + [f"B{i}" for i in range(m - warmup, m)])
""",
    "the cool-down's backwards forgotten": """
def order_1f1b(p, s, m):
    warmup = p - s
    words = [f"F{i}" for i in range(warmup)]
    for i in range(m - warmup):
        words += [f"B{i}", f"F{warmup + i}"]
    return " ".join(words)
""",
}


@pytest.mark.parametrize("wrong", list(ORDER_WRONG))
def test_16_order_must_be_what_schedule_1f1b_runs(ip, cluster, wrong):
    assert_checker(ip, LESSON, 1, ORDER_WRONG[wrong], WORLD)


def test_16_a_list_of_actions_passes(ip, cluster):
    """The order given as a list of words instead of one string is accepted."""
    as_list = """
def order_1f1b(p, s, m):
    warmup = p - s
    words = [f"F{i}" for i in range(warmup)]
    for i in range(m - warmup):
        words += [f"B{i}", f"F{warmup + i}"]
    return words + [f"B{i}" for i in range(m - warmup, m)]
"""
    assert set(check(ip, LESSON, 1, as_list, WORLD).values()) == {"pass"}


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
        1: ORDER_WRONG["the stages reversed (a warm-up of s + 1 forwards)"],
        2: STAGE_WRONG["the blocks dealt round-robin (rank, rank + world_size)"],
    }
    assert_run_all(ip, LESSON, wrong, WORLD)
