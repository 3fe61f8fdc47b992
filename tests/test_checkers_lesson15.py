"""Lesson 15's checkers fail the obvious wrong answers and pass the reference solutions.

As in tests/test_checkers.py: on a real gloo cluster of 4 ranks (the lesson's), with the lesson's imports,
its 1-D ``mesh`` and the exercises' ``FeedForward`` block defined on every rank (exercise 3 needs only the
imports), the lesson's own checker cell
runs after a wrong solution (every rank must print ``not yet``) and after the lesson's reference solution
(every rank ``pass``).
"""

from __future__ import annotations

import pytest

from tests.checker_harness import assert_checker, assert_run_all, lesson_cell, on_ranks
from tests.conftest import running_cluster

LESSON = "15_tensor_parallel"
WORLD = 4


@pytest.fixture(scope="module")
def lesson_ranks(ip):
    """4 ranks holding the lesson's imports, ``mesh`` (all ranks, ``tp``) and ``FeedForward``."""
    with running_cluster(ip, WORLD) as magics:
        on_ranks(ip, lesson_cell(LESSON, "mesh = init_device_mesh(device.type, (world_size,)"))
        on_ranks(ip, lesson_cell(LESSON, "class FeedForward("))
        yield magics


# exercise 1: a parallelize plan for the gated feed-forward block

PLAN_WRONG = {
    "empty plan (nothing sharded)": """
ffn_plan = {}
""",
    "w3 left whole": """
ffn_plan = {"w1": ColwiseParallel(), "w2": RowwiseParallel()}
""",
    "hidden units gathered (three collectives)": """
ffn_plan = {
    "w1": ColwiseParallel(output_layouts=Replicate()),
    "w3": ColwiseParallel(output_layouts=Replicate()),
    "w2": RowwiseParallel(input_layouts=Replicate()),
}
""",
    "row-parallel first, column-parallel last": """
ffn_plan = {"w1": RowwiseParallel(), "w3": RowwiseParallel(), "w2": ColwiseParallel()}
""",
    "every layer column-parallel": """
ffn_plan = {"w1": ColwiseParallel(), "w3": ColwiseParallel(), "w2": ColwiseParallel()}
""",
}


@pytest.mark.parametrize("wrong", list(PLAN_WRONG))
def test_15_plan_must_shard_every_weight_with_one_all_reduce(ip, lesson_ranks, wrong):
    assert_checker(ip, LESSON, 1, PLAN_WRONG[wrong], WORLD)


# exercise 2: the Megatron MLP by hand, one all_reduce

MLP_WRONG = {
    "no communication (each rank's share returned)": """
def megatron_mlp(x, w1_rows, b1_rows, w2_cols, b2):
    return F.relu(x @ w1_rows.T + b1_rows) @ w2_cols.T + b2
""",
    "the bias added on every rank before the sum": """
def megatron_mlp(x, w1_rows, b1_rows, w2_cols, b2):
    partial = F.relu(x @ w1_rows.T + b1_rows) @ w2_cols.T + b2
    dist.all_reduce(partial)
    return partial
""",
    "ReLU after the sum": """
def megatron_mlp(x, w1_rows, b1_rows, w2_cols, b2):
    partial = (x @ w1_rows.T + b1_rows) @ w2_cols.T
    dist.all_reduce(partial)
    return F.relu(partial) + b2
""",
    "a second collective (right values)": """
def megatron_mlp(x, w1_rows, b1_rows, w2_cols, b2):
    partial = F.relu(x @ w1_rows.T + b1_rows) @ w2_cols.T
    dist.all_reduce(partial)
    dist.broadcast(partial, src=0)
    return partial + b2
""",
}


@pytest.mark.parametrize("wrong", list(MLP_WRONG))
def test_15_megatron_mlp_must_sum_the_shares_once(ip, lesson_ranks, wrong):
    assert_checker(ip, LESSON, 2, MLP_WRONG[wrong], WORLD)


# exercise 3: the vocabulary-parallel cross-entropy by hand, at most three all-reduces

LOSS_WRONG = {
    "the logits gathered, then F.cross_entropy": """
def vocab_parallel_loss(local_logits, labels, vocab_start):
    pieces = [torch.empty_like(local_logits) for _ in range(world_size)]
    dist.all_gather(pieces, local_logits)
    return F.cross_entropy(torch.cat(pieces, dim=1), labels)
""",
    "exp() without subtracting the largest logit": """
def vocab_parallel_loss(local_logits, labels, vocab_start):
    total = local_logits.exp().sum(dim=1)
    dist.all_reduce(total)
    here = (labels >= vocab_start) & (labels < vocab_start + local_logits.shape[1])
    column = (labels - vocab_start).clamp(0, local_logits.shape[1] - 1)
    target = torch.where(here, local_logits.gather(1, column[:, None])[:, 0], torch.zeros_like(total))
    dist.all_reduce(target)
    return (total.log() - target).mean()
""",
    "each rank's largest logit, not the global one": """
def vocab_parallel_loss(local_logits, labels, vocab_start):
    largest = local_logits.max(dim=1).values
    shifted = local_logits - largest[:, None]
    total = shifted.exp().sum(dim=1)
    dist.all_reduce(total)
    here = (labels >= vocab_start) & (labels < vocab_start + local_logits.shape[1])
    column = (labels - vocab_start).clamp(0, local_logits.shape[1] - 1)
    target = torch.where(here, shifted.gather(1, column[:, None])[:, 0], torch.zeros_like(largest))
    dist.all_reduce(target)
    return (total.log() - target).mean()
""",
    "the target logit taken on every rank (no mask)": """
def vocab_parallel_loss(local_logits, labels, vocab_start):
    largest = local_logits.max(dim=1).values
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    shifted = local_logits - largest[:, None]
    total = shifted.exp().sum(dim=1)
    dist.all_reduce(total)
    column = (labels - vocab_start).clamp(0, local_logits.shape[1] - 1)
    target = shifted.gather(1, column[:, None])[:, 0]
    dist.all_reduce(target)
    return (total.log() - target).mean()
""",
    "each rank's cross-entropy over its own classes, averaged": """
def vocab_parallel_loss(local_logits, labels, vocab_start):
    column = (labels - vocab_start).clamp(0, local_logits.shape[1] - 1)
    loss = F.cross_entropy(local_logits, column)
    dist.all_reduce(loss)
    return loss / world_size
""",
    "four all-reduces (the loss summed again)": """
def vocab_parallel_loss(local_logits, labels, vocab_start):
    largest = local_logits.max(dim=1).values
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    shifted = local_logits - largest[:, None]
    total = shifted.exp().sum(dim=1)
    dist.all_reduce(total)
    here = (labels >= vocab_start) & (labels < vocab_start + local_logits.shape[1])
    column = (labels - vocab_start).clamp(0, local_logits.shape[1] - 1)
    target = torch.where(here, shifted.gather(1, column[:, None])[:, 0], torch.zeros_like(largest))
    dist.all_reduce(target)
    loss = (total.log() - target).mean()
    dist.all_reduce(loss)
    return loss / world_size
""",
}


@pytest.mark.parametrize("wrong", list(LOSS_WRONG))
def test_15_vocab_parallel_loss_must_match_cross_entropy_with_three_all_reduces(ip, lesson_ranks, wrong):
    assert_checker(ip, LESSON, 3, LOSS_WRONG[wrong], WORLD)


def test_15_run_all_checks_the_learners_answers(ip, lesson_ranks):
    wrong = {
        1: PLAN_WRONG["w3 left whole"],
        2: MLP_WRONG["the bias added on every rank before the sum"],
        3: LOSS_WRONG["each rank's largest logit, not the global one"],
    }
    assert_run_all(ip, LESSON, wrong, WORLD)
