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


# exercise 1: one norm over DTensors of any placement, in one collective of at most world_size numbers

NORM_WRONG = {
    "one all-reduce per mesh, as section 8 (two collectives)": """
def total_norm(tensors):
    two_d = torch.zeros((), device=device)
    one_d = torch.zeros((), device=device)
    for t in tensors:
        if t.device_mesh.ndim == 2:
            two_d += t.to_local().pow(2).sum()
        else:
            one_d += t.to_local().pow(2).sum() * t.device_mesh.size() / world_size
    dist.all_reduce(two_d)
    dist.all_reduce(one_d)
    return (two_d + one_d).sqrt()
""",
    "the lesson's rule for its model only (replicated placements counted on every rank)": """
def total_norm(tensors):
    squares = torch.zeros((), device=device)
    for t in tensors:
        local = t.to_local().pow(2).sum()
        squares += local if t.device_mesh.ndim == 2 else local * t.device_mesh.size() / world_size
    dist.all_reduce(squares)
    return squares.sqrt()
""",
    "every piece counted on every rank (no weights)": """
def total_norm(tensors):
    squares = sum(t.to_local().pow(2).sum() for t in tensors)
    dist.all_reduce(squares)
    return squares.sqrt()
""",
    "every tensor gathered whole (full_tensor)": """
def total_norm(tensors):
    return torch.sqrt(sum(t.full_tensor().pow(2).sum() for t in tensors))
""",
    "every rank's weighted pieces gathered by a from-imported all_gather_into_tensor": """
def total_norm(tensors):
    from torch.distributed import all_gather_into_tensor
    parts = []
    for t in tensors:
        pieces = 1
        for dim, placement in enumerate(t.placements):
            if not placement.is_replicate():
                pieces *= t.device_mesh.size(dim)
        parts.append(t.to_local().flatten() * (pieces / world_size) ** 0.5)
    local = torch.cat(parts)
    sizes = [None] * world_size
    dist.all_gather_object(sizes, local.numel())
    padded = torch.zeros(max(sizes), device=device)
    padded[:local.numel()] = local
    gathered = torch.empty(world_size * padded.numel(), device=device)
    all_gather_into_tensor(gathered, padded)
    return gathered.pow(2).sum().sqrt()
""",
    "this rank's pieces only": """
def total_norm(tensors):
    return torch.nn.utils.get_total_norm([t.to_local() for t in tensors])
""",
}


@pytest.mark.parametrize("wrong", list(NORM_WRONG))
def test_19_total_norm_in_one_small_collective(ip, lesson_ranks, wrong):
    assert_checker(ip, LESSON, 1, NORM_WRONG[wrong], WORLD)


def test_19_total_norm_from_the_first_rank_of_each_copy_passes(ip, lesson_ranks):
    """Another right way to count each piece once: only the ranks at coordinate 0 of every dimension that
    holds copies add it (a replicated dimension, or the mesh dimension the DTensor does not live on)."""
    first_copy_only = """
def total_norm(tensors):
    squares = torch.zeros((), device=device)
    for t in tensors:
        mesh = t.device_mesh
        mine = all(mesh.get_local_rank(dim) == 0
                   for dim, placement in enumerate(t.placements) if placement.is_replicate())
        if mesh.ndim == 1:
            full = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else None
            other = [name for name in full.mesh_dim_names if name != mesh.mesh_dim_names[0]]
            mine = mine and full.get_local_rank(other[0]) == 0
        if mine:
            squares += torch.linalg.vector_norm(t.to_local()) ** 2
    dist.all_reduce(squares)
    return squares.sqrt()
"""
    assert_accepted(ip, 1, first_copy_only)


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
        1: NORM_WRONG["every piece counted on every rank (no weights)"],
        2: ACCUMULATE_WRONG["a plain loop: FSDP reduce-scatters after every micro-batch"],
    }
    assert_run_all(ip, LESSON, wrong, WORLD)
