"""Lesson 15's checkers fail wrong answers and wrong methods, and pass the reference and other right answers.

On a real gloo cluster of 4 ranks (the lesson's), with the lesson's imports and its 1-D ``mesh`` defined on
every rank, the lesson's own checker cell runs after a wrong solution (every rank must print ``not yet``) and
after the lesson's reference solution (every rank ``pass``). The checkers count the collectives and the sizes
of the all-reduces the answer makes.
"""

from __future__ import annotations

import pytest

from tests.checker_harness import assert_checker, assert_run_all, check, lesson_cell, on_ranks
from tests.conftest import running_cluster

LESSON = "15_tensor_parallel"
WORLD = 4


@pytest.fixture(scope="module")
def lesson_ranks(ip):
    """4 ranks holding the lesson's imports and ``mesh`` (all ranks, ``tp``)."""
    with running_cluster(ip, WORLD) as magics:
        on_ranks(ip, lesson_cell(LESSON, "mesh = init_device_mesh(device.type, (world_size,)"))
        yield magics


# exercise 1: an MLP whose input and output are split by features: the hidden pre-activations summed once

FEATURES_WRONG = {
    "ReLU on the partial sums, the output summed": """
def feature_split_mlp(x_cols, w1_cols, b1, w2_rows, b2_rows):
    hidden = F.relu(x_cols @ w1_cols.T + b1 / world_size)
    return hidden @ w2_rows.T + b2_rows
""",
    "the input all-gathered (a second collective would be needed for w1)": """
def feature_split_mlp(x_cols, w1_cols, b1, w2_rows, b2_rows):
    pieces = [torch.empty_like(x_cols) for _ in range(world_size)]
    dist.all_gather(pieces, x_cols)
    partial = x_cols @ w1_cols.T
    dist.all_reduce(partial)
    return F.relu(partial + b1) @ w2_rows.T + b2_rows
""",
    "the bias added on every rank before the sum": """
def feature_split_mlp(x_cols, w1_cols, b1, w2_rows, b2_rows):
    partial = x_cols @ w1_cols.T + b1
    dist.all_reduce(partial)
    return F.relu(partial) @ w2_rows.T + b2_rows
""",
    "the whole output rebuilt by a zero-padded all-reduce": """
def feature_split_mlp(x_cols, w1_cols, b1, w2_rows, b2_rows):
    n = x_cols.shape[1]
    x = torch.zeros(x_cols.shape[0], n * world_size, device=x_cols.device)
    x[:, rank * n:(rank + 1) * n] = x_cols
    w1 = torch.zeros(w1_cols.shape[0], n * world_size, device=x_cols.device)
    w1[:, rank * n:(rank + 1) * n] = w1_cols
    both = torch.cat([x.flatten(), w1.flatten()])
    dist.all_reduce(both)
    x, w1 = both[:x.numel()].reshape(x.shape), both[x.numel():].reshape(w1.shape)
    return F.relu(x @ w1.T + b1) @ w2_rows.T + b2_rows
""",
}


@pytest.mark.parametrize("wrong", list(FEATURES_WRONG))
def test_15_feature_split_mlp_must_sum_the_hidden_once(ip, lesson_ranks, wrong):
    assert_checker(ip, LESSON, 1, FEATURES_WRONG[wrong], WORLD)


def test_15_feature_split_mlp_summed_in_place_of_a_copy_passes(ip, lesson_ranks):
    """Another right answer: the bias added by one rank only before the sum, the ReLU after."""
    one_bias = """
def feature_split_mlp(x_cols, w1_cols, b1, w2_rows, b2_rows):
    partial = torch.addmm(b1 if rank == 0 else torch.zeros_like(b1), x_cols, w1_cols.T)
    dist.all_reduce(partial)
    return torch.relu(partial) @ w2_rows.T + b2_rows
"""
    assert set(check(ip, LESSON, 1, one_bias, WORLD).values()) == {"pass"}


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
    "the logits rebuilt by one all-reduce of zero-padded columns": """
def vocab_parallel_loss(local_logits, labels, vocab_start):
    n = local_logits.shape[1]
    whole = torch.zeros(local_logits.shape[0], n * world_size, device=local_logits.device)
    whole[:, vocab_start:vocab_start + n] = local_logits
    dist.all_reduce(whole)
    return F.cross_entropy(whole, labels)
""",
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


def test_15_vocab_parallel_loss_with_two_all_reduces_passes(ip, lesson_ranks):
    """Another right method: the sum of exponentials and the target's logit summed together, in one
    all-reduce of two numbers per token after the maximum's."""
    two = """
def vocab_parallel_loss(local_logits, labels, vocab_start):
    top = local_logits.max(dim=1).values
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    shifted = local_logits - top[:, None]
    n = local_logits.shape[1]
    mine = (labels >= vocab_start) & (labels < vocab_start + n)
    target = shifted.gather(1, (labels - vocab_start).clamp(0, n - 1)[:, None])[:, 0] * mine
    both = torch.stack([shifted.exp().sum(dim=1), target])
    dist.all_reduce(both)
    return (both[0].log() - both[1]).mean()
"""
    assert set(check(ip, LESSON, 3, two, WORLD).values()) == {"pass"}


def test_15_run_all_checks_the_learners_answers(ip, lesson_ranks):
    wrong = {
        1: FEATURES_WRONG["the bias added on every rank before the sum"],
        2: MLP_WRONG["the bias added on every rank before the sum"],
        3: LOSS_WRONG["each rank's largest logit, not the global one"],
    }
    assert_run_all(ip, LESSON, wrong, WORLD)
