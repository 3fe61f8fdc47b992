"""Lesson 19's checkers fail the obvious wrong answers and pass the reference solutions.

As in tests/test_checkers.py: on a real gloo cluster of 2 ranks, with the lesson's set-up cell run on every
rank (``TinyLM``, ``Block``, ``TP_PLAN``, the imports; it builds no mesh, so two ranks do), the lesson's own
checker cell runs after a wrong solution (every rank must print ``not yet``) and after the lesson's reference
solution (every rank ``pass``). Exercise 2's checker splits a block over a 1-D mesh of the 2 ranks, each with
half of the sequence.
"""

from __future__ import annotations

import pytest

from tests.checker_harness import assert_checker, assert_run_all, lesson_cell, on_ranks
from tests.conftest import running_cluster

LESSON = "19_capstone"
WORLD = 2


@pytest.fixture(scope="module")
def lesson_ranks(ip):
    """2 ranks holding the lesson's set-up."""
    with running_cluster(ip, WORLD) as magics:
        on_ranks(ip, lesson_cell(LESSON, '"""Lesson 19\'s set-up'))
        yield magics


# exercise 1: bytes of parameters, gradients and Adam's moments per rank

STATE_WRONG = {
    "parameters only (4 bytes each)": """
def state_bytes(model, dp, tp, tp_layers):
    return sum(4 * p.numel() // (dp * tp if name.split(".")[-2] in tp_layers else dp)
               for name, p in model.named_parameters())
""",
    "everything divided by dp * tp": """
def state_bytes(model, dp, tp, tp_layers):
    return sum(16 * p.numel() // (dp * tp) for p in model.parameters())
""",
    "TP layers divided by tp only": """
def state_bytes(model, dp, tp, tp_layers):
    return sum(16 * p.numel() // (tp if name.split(".")[-2] in tp_layers else dp)
               for name, p in model.named_parameters())
""",
    "Adam's moments forgotten (12 bytes)": """
def state_bytes(model, dp, tp, tp_layers):
    return sum(8 * p.numel() // (dp * tp if name.split(".")[-2] in tp_layers else dp)
               for name, p in model.named_parameters())
""",
}


@pytest.mark.parametrize("wrong", list(STATE_WRONG))
def test_19_state_bytes_must_follow_the_formula(ip, lesson_ranks, wrong):
    assert_checker(ip, LESSON, 1, STATE_WRONG[wrong], WORLD)


# exercise 2: a sequence-parallel plan for a block (input and output this rank's tokens, no all-reduce)

SP_IMPORTS = """
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import PrepareModuleInput, SequenceParallel
"""

PLAN_WRONG = {
    "the lesson's TP_PLAN (inputs taken as replicated: all-reduces, attention over my tokens only)": """
sp_block_plan = dict(TP_PLAN)
""",
    "norms left plain (their weights' gradients never summed over the ranks)": SP_IMPORTS + """
sp_block_plan = {
    "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
    "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
    "attn.out": RowwiseParallel(output_layouts=Shard(1)),
    "up": ColwiseParallel(input_layouts=Shard(1)),
    "down": RowwiseParallel(output_layouts=Shard(1)),
}
""",
    "row-parallel outputs all-reduced (Replicate), not reduce-scattered": SP_IMPORTS + """
sp_block_plan = {
    "norm1": SequenceParallel(),
    "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
    "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
    "attn.out": RowwiseParallel(),
    "norm2": SequenceParallel(),
    "up": ColwiseParallel(input_layouts=Shard(1)),
    "down": RowwiseParallel(),
}
""",
    "the MLP only, attention left whole": SP_IMPORTS + """
sp_block_plan = {"norm2": SequenceParallel(), "up": ColwiseParallel(input_layouts=Shard(1)),
                 "down": RowwiseParallel(output_layouts=Shard(1))}
""",
}


@pytest.mark.parametrize("wrong", list(PLAN_WRONG))
def test_19_sp_block_plan_must_shard_the_sequence(ip, lesson_ranks, wrong):
    assert_checker(ip, LESSON, 2, PLAN_WRONG[wrong], WORLD)


def test_19_run_all_checks_the_learners_answers(ip, lesson_ranks):
    wrong = {
        1: STATE_WRONG["everything divided by dp * tp"],
        2: PLAN_WRONG["norms left plain (their weights' gradients never summed over the ranks)"],
    }
    assert_run_all(ip, LESSON, wrong, WORLD)
