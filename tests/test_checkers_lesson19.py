"""Lesson 19's checkers fail wrong answers and wrong methods, and pass the reference and other right answers.

On a real gloo cluster of 2 ranks, with the lesson's set-up cell run on every rank (``TinyLM``, ``build``,
``TP_PLAN``, ``IDS``, the imports; it builds no mesh, so two ranks do), the lesson's own checker cell runs
after a wrong solution (every rank must print ``not yet``) and after the lesson's reference solution (every
rank ``pass``). Both checkers build their own meshes, every two-dimensional shape of the ranks
(1 x 2 and 2 x 1 here), and count the collectives the answer makes.
"""

from __future__ import annotations

import pytest

from tests.checker_harness import assert_checker, assert_run_all, check, lesson_cell, on_ranks
from tests.conftest import running_cluster

LESSON = "19_capstone"
WORLD = 2


@pytest.fixture(scope="module")
def lesson_ranks(ip):
    """2 ranks holding the lesson's set-up."""
    with running_cluster(ip, WORLD) as magics:
        on_ranks(ip, lesson_cell(LESSON, '"""Lesson 19\'s set-up'))
        yield magics


def assert_accepted(ip, exercise: int, answer: str) -> None:
    assert set(check(ip, LESSON, exercise, answer, WORLD).values()) == {"pass"}


# exercise 1: the norm of all the gradients on a 2-D mesh, in one collective

NORM_WRONG = {
    "one all-reduce per mesh, as section 8 (two collectives)": """
def total_grad_norm(model, mesh):
    tp = mesh["tp"].size()
    two_d = torch.zeros((), device=device)
    one_d = torch.zeros((), device=device)
    for p in model.parameters():
        if p.grad.device_mesh.ndim == 2:
            two_d += p.grad.to_local().pow(2).sum()
        else:
            one_d += p.grad.to_local().pow(2).sum()
    dist.all_reduce(two_d)
    dist.all_reduce(one_d, group=mesh["dp"].get_group())
    return (two_d + one_d).sqrt()
""",
    "the dp-only gradients counted once per tp rank": """
def total_grad_norm(model, mesh):
    squares = sum(p.grad.to_local().pow(2).sum() for p in model.parameters())
    dist.all_reduce(squares)
    return squares.sqrt()
""",
    "every gradient gathered whole (full_tensor)": """
def total_grad_norm(model, mesh):
    return torch.sqrt(sum(p.grad.full_tensor().pow(2).sum() for p in model.parameters()))
""",
    "every rank's shards gathered in one all_gather_into_tensor": """
def total_grad_norm(model, mesh):
    tp = mesh["tp"].size()
    local = torch.cat([p.grad.to_local().flatten() / (1 if p.grad.device_mesh.ndim == 2 else tp ** 0.5)
                       for p in model.parameters()])
    gathered = torch.empty(world_size * local.numel(), device=device)
    dist.all_gather_into_tensor(gathered, local)
    return gathered.pow(2).sum().sqrt()
""",
    "every rank's shards gathered, all_gather_into_tensor imported from torch.distributed": """
def total_grad_norm(model, mesh):
    from torch.distributed import all_gather_into_tensor
    tp = mesh["tp"].size()
    local = torch.cat([p.grad.to_local().flatten() / (1 if p.grad.device_mesh.ndim == 2 else tp ** 0.5)
                       for p in model.parameters()])
    gathered = torch.empty(world_size * local.numel(), device=device)
    all_gather_into_tensor(gathered, local)
    return gathered.pow(2).sum().sqrt()
""",
    "this rank's shards only": """
def total_grad_norm(model, mesh):
    return torch.nn.utils.get_total_norm([p.grad.to_local() for p in model.parameters()])
""",
}


@pytest.mark.parametrize("wrong", list(NORM_WRONG))
def test_19_total_grad_norm_in_one_small_collective(ip, lesson_ranks, wrong):
    assert_checker(ip, LESSON, 1, NORM_WRONG[wrong], WORLD)


def test_19_total_grad_norm_from_one_tp_rank_passes(ip, lesson_ranks):
    """Another right way to count the replicated gradients once: only tp rank 0 adds them."""
    first_tp_rank_only = """
def total_grad_norm(model, mesh):
    mine = mesh.get_local_rank("tp") == 0
    squares = torch.zeros((), device=device)
    for p in model.parameters():
        if p.grad.device_mesh.ndim == 2 or mine:
            squares += torch.linalg.vector_norm(p.grad.to_local()) ** 2
    dist.all_reduce(squares)
    return squares.sqrt()
"""
    assert_accepted(ip, 1, first_tp_rank_only)


# exercise 2: one optimizer step over k micro-batches, FSDP reducing the gradients once

ACCUMULATE_WRONG = {
    "a plain loop: FSDP reduce-scatters after every micro-batch": """
def accumulate_step(model, optimizer, ids, k):
    optimizer.zero_grad()
    for chunk in ids.chunk(k):
        (next_token_loss(model, chunk) / k).backward()
    optimizer.step()
""",
    "the micro-batches' losses summed, not averaged": """
def accumulate_step(model, optimizer, ids, k):
    optimizer.zero_grad()
    for i, chunk in enumerate(ids.chunk(k)):
        model.set_requires_gradient_sync(i == k - 1)
        next_token_loss(model, chunk).backward()
    optimizer.step()
""",
    "a step after every micro-batch": """
def accumulate_step(model, optimizer, ids, k):
    for i, chunk in enumerate(ids.chunk(k)):
        optimizer.zero_grad()
        model.set_requires_gradient_sync(i == k - 1)
        next_token_loss(model, chunk).backward()
        optimizer.step()
""",
    "no micro-batches: one step on the whole batch": """
def accumulate_step(model, optimizer, ids, k):
    optimizer.zero_grad()
    next_token_loss(model, ids).backward()
    optimizer.step()
""",
    "the gradients never reduced": """
def accumulate_step(model, optimizer, ids, k):
    optimizer.zero_grad()
    model.set_requires_gradient_sync(False)
    for chunk in ids.chunk(k):
        (next_token_loss(model, chunk) / k).backward()
    optimizer.step()
    model.set_requires_gradient_sync(True)
""",
}


@pytest.mark.parametrize("wrong", list(ACCUMULATE_WRONG))
def test_19_accumulate_step_reduces_once(ip, lesson_ranks, wrong):
    assert_checker(ip, LESSON, 2, ACCUMULATE_WRONG[wrong], WORLD)


def test_19_accumulate_step_kept_gathered_passes(ip, lesson_ranks):
    """Another right answer: the gradients divided after the backwards, and the groups kept gathered between
    micro-batches (fewer all-gathers, same reduce-scatters)."""
    kept_gathered = """
def accumulate_step(model, optimizer, ids, k):
    optimizer.zero_grad()
    for i, chunk in enumerate(ids.chunk(k)):
        last = i == k - 1
        model.set_requires_gradient_sync(last)
        model.set_reshard_after_backward(last)
        next_token_loss(model, chunk).backward()
    for p in model.parameters():
        p.grad /= k
    optimizer.step()
"""
    assert_accepted(ip, 2, kept_gathered)


def test_19_run_all_checks_the_learners_answers(ip, lesson_ranks):
    wrong = {
        1: NORM_WRONG["the dp-only gradients counted once per tp rank"],
        2: ACCUMULATE_WRONG["a plain loop: FSDP reduce-scatters after every micro-batch"],
    }
    assert_run_all(ip, LESSON, wrong, WORLD)
