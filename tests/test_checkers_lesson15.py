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


# exercise 2: the Megatron MLP's backward by hand, one all-reduce of the input's gradient

BACKWARD_BODY = """
    pre = x @ w1_rows.T + b1_rows
    hidden = F.relu(pre)
    grad_b2 = grad_y.sum(0)
    grad_w2_cols = grad_y.T @ hidden
    grad_pre = (grad_y @ w2_cols) * (pre > 0)
    grad_w1_rows, grad_b1_rows = grad_pre.T @ x, grad_pre.sum(0)
    grad_x = grad_pre @ w1_rows
"""
BACKWARD_WRONG = {
    "the input's gradient never summed": """
def megatron_mlp_backward(x, w1_rows, b1_rows, w2_cols, grad_y):""" + BACKWARD_BODY + """
    return grad_x, grad_w1_rows, grad_b1_rows, grad_w2_cols, grad_b2
""",
    "b2's gradient summed over the ranks as well (a second collective)": """
def megatron_mlp_backward(x, w1_rows, b1_rows, w2_cols, grad_y):""" + BACKWARD_BODY + """
    dist.all_reduce(grad_x)
    dist.all_reduce(grad_b2)
    return grad_x, grad_w1_rows, grad_b1_rows, grad_w2_cols, grad_b2 / world_size
""",
    "the ReLU's mask left out": """
def megatron_mlp_backward(x, w1_rows, b1_rows, w2_cols, grad_y):
    hidden = F.relu(x @ w1_rows.T + b1_rows)
    grad_pre = grad_y @ w2_cols
    grad_x = grad_pre @ w1_rows
    dist.all_reduce(grad_x)
    return grad_x, grad_pre.T @ x, grad_pre.sum(0), grad_y.T @ hidden, grad_y.sum(0)
""",
    "whole weights rebuilt by one from-imported all_reduce of zero-padded pieces": """
def megatron_mlp_backward(x, w1_rows, b1_rows, w2_cols, grad_y):
    from torch.distributed import all_reduce
    n = w1_rows.shape[0]
    mine = slice(rank * n, (rank + 1) * n)
    w1 = torch.zeros(n * world_size, x.shape[1])
    w1[mine] = w1_rows
    all_reduce(w1)
    pre = x @ w1_rows.T + b1_rows
    grad_pre = (grad_y @ w2_cols) * (pre > 0)
    full_pre = torch.zeros(x.shape[0], n * world_size)
    full_pre[:, mine] = grad_pre
    grad_x = full_pre @ w1
    return grad_x, grad_pre.T @ x, grad_pre.sum(0), grad_y.T @ F.relu(pre), grad_y.sum(0)
""",
}


@pytest.mark.parametrize("wrong", list(BACKWARD_WRONG))
def test_15_megatron_mlp_backward_sums_the_input_gradient_once(ip, lesson_ranks, wrong):
    assert_checker(ip, LESSON, 2, BACKWARD_WRONG[wrong], WORLD)


def test_15_megatron_mlp_backward_with_a_functional_all_reduce_passes(ip, lesson_ranks):
    """Another right answer: the input's gradient summed by a functional collective, einsum for the rest."""
    functional = """
def megatron_mlp_backward(x, w1_rows, b1_rows, w2_cols, grad_y):
    import torch.distributed._functional_collectives as funcol
    pre = torch.addmm(b1_rows, x, w1_rows.T)
    grad_pre = torch.where(pre > 0, torch.einsum("td,dh->th", grad_y, w2_cols), 0.0)
    grad_x = funcol.all_reduce(grad_pre @ w1_rows, "sum", dist.group.WORLD)
    return (grad_x, torch.einsum("th,td->hd", grad_pre, x), grad_pre.sum(0),
            torch.einsum("td,th->dh", grad_y, pre.clamp(min=0)), grad_y.sum(0))
"""
    assert set(check(ip, LESSON, 2, functional, WORLD).values()) == {"pass"}


# exercise 3: the vocabulary-parallel cross-entropy by hand, at most two all-reduces

LOSS_WRONG = {
    "the logits rebuilt by one all-reduce of zero-padded columns": """
def vocab_parallel_loss(local_logits, labels, vocab_start):
    n = local_logits.shape[1]
    whole = torch.zeros(local_logits.shape[0], n * world_size, device=local_logits.device)
    whole[:, vocab_start:vocab_start + n] = local_logits
    dist.all_reduce(whole)
    return F.cross_entropy(whole, labels)
""",
    "the logits rebuilt by a from-imported all_reduce of zero-padded columns": """
def vocab_parallel_loss(local_logits, labels, vocab_start):
    from torch.distributed import all_reduce
    n = local_logits.shape[1]
    whole = torch.zeros(local_logits.shape[0], n * world_size, device=local_logits.device)
    whole[:, vocab_start:vocab_start + n] = local_logits
    all_reduce(whole)
    return F.cross_entropy(whole, labels)
""",
    "three all-reduces, as loss_parallel makes": """
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
    return (total.log() - target).mean()
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
def test_15_vocab_parallel_loss_must_match_cross_entropy_with_two_all_reduces(ip, lesson_ranks, wrong):
    assert_checker(ip, LESSON, 3, LOSS_WRONG[wrong], WORLD)


def test_15_vocab_parallel_loss_by_group_calls_and_logsumexp_passes(ip, lesson_ranks):
    """Another right method: the process group's own allreduce, the target's logit subtracted before the
    sum, and logsumexp."""
    by_group = """
def vocab_parallel_loss(local_logits, labels, vocab_start):
    group = dist.group.WORLD
    top = local_logits.max(dim=1).values
    group.allreduce([top], dist.ReduceOp.MAX).wait()
    n = local_logits.shape[1]
    mine = (labels >= vocab_start) & (labels < vocab_start + n)
    target = local_logits.gather(1, (labels - vocab_start).clamp(0, n - 1)[:, None])[:, 0] * mine
    both = torch.stack([(local_logits - top[:, None]).exp().sum(dim=1), target])
    group.allreduce([both]).wait()
    return (top + both[0].log() - both[1]).mean()
"""
    assert set(check(ip, LESSON, 3, by_group, WORLD).values()) == {"pass"}


def test_15_run_all_checks_the_learners_answers(ip, lesson_ranks):
    wrong = {
        1: FEATURES_WRONG["the bias added on every rank before the sum"],
        2: BACKWARD_WRONG["the ReLU's mask left out"],
        3: LOSS_WRONG["each rank's largest logit, not the global one"],
    }
    assert_run_all(ip, LESSON, wrong, WORLD)
