"""Lesson 05's exercise checkers refuse wrong answers and pass the reference solutions
(tests/checker_harness.py says how)."""

from __future__ import annotations

import pytest

from tests.checker_harness import assert_checker, assert_run_all, lesson_cell, on_ranks
from tests.conftest import running_cluster

# lesson 05: one all_reduce of every gradient at once; a weighted average of uneven shards' gradients

FLAT_WORLD_SIZE_WRITTEN_AS_TWO = """
def average_gradients_flat(model):
    flat = torch.cat([p.grad.flatten() for p in model.parameters()])
    dist.all_reduce(flat)
    flat /= 2  # right only on 2 ranks
    offset = 0
    for p in model.parameters():
        p.grad.copy_(flat[offset:offset + p.grad.numel()].view_as(p.grad))
        offset += p.grad.numel()
"""


def test_05_checkers_at_four_ranks(ip):
    """Runs first, before the module's 2-rank cluster starts: a world size written in as 2 is refused on 4
    ranks, and both references pass there."""
    with running_cluster(ip, 4):
        lesson05_setup(ip)
        assert_checker(ip, "05_distributed_sgd", 1, FLAT_WORLD_SIZE_WRITTEN_AS_TWO, 4)
        assert_checker(ip, "05_distributed_sgd", 2, WEIGHTED_WRONG["total written in by hand"], 4)

WEIGHTED_WRONG = {
    "no communication": """
def average_gradients_weighted(model, n_local):
    X15, y15 = make_data(n=15)  # the whole data set, rebuilt locally instead of communicating
    full = make_model().to(device)
    F.mse_loss(full(X15.to(device)), y15.to(device)).backward()
    for p, q in zip(model.parameters(), full.parameters()):
        p.grad.copy_(q.grad)
""",
    "total written in by hand": """
def average_gradients_weighted(model, n_local):
    for p in model.parameters():
        p.grad *= n_local
        dist.all_reduce(p.grad)
        p.grad /= 15  # right only for the 15 samples of the exercise text
""",
    "a token all_reduce of every value, the gradients sent point to point": """
def average_gradients_weighted(model, n_local):
    total = torch.tensor([float(n_local)])
    dist.all_reduce(total)
    grads = [p.grad for p in model.parameters()]
    dist.all_reduce(torch.zeros(sum(g.numel() for g in grads)))  # as many values as the gradients, all zeros
    for g in grads:
        g *= n_local
        for other in range(world_size):
            if other != rank:
                theirs = torch.empty_like(g)
                ops = [dist.P2POp(dist.isend, g.clone(), other), dist.P2POp(dist.irecv, theirs, other)]
                for work in dist.batch_isend_irecv(ops):
                    work.wait()
                g += theirs
        g /= total
""",
}


@pytest.mark.parametrize("wrong", list(WEIGHTED_WRONG))
def test_05_weighted_average_must_communicate(ip, cluster, wrong):
    for text in ("X_full, y_full = make_data()", "X = X_all.tensor_split"):  # make_data, make_model, X, y
        on_ranks(ip, lesson_cell("05_distributed_sgd", text))
    assert_checker(ip, "05_distributed_sgd", 2, WEIGHTED_WRONG[wrong], 2)


FLAT_WRONG = {
    "one all_reduce per parameter": """
def average_gradients_flat(model):
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world_size
""",
    "a token all_reduce, the gradients recomputed locally": """
def average_gradients_flat(model):
    dist.all_reduce(torch.zeros(1, device=device))  # one collective, but nothing of the gradients travels
    full = make_model().to(device)
    F.mse_loss(full(X_all.to(device)), y_all.to(device)).backward()
    for p, q in zip(model.parameters(), full.parameters()):
        p.grad.copy_(q.grad)
""",
    "one all_reduce of zeros, the gradients sent point to point": """
def average_gradients_flat(model):
    grads = [p.grad for p in model.parameters()]
    dist.all_reduce(torch.zeros(sum(g.numel() for g in grads)))  # the right size, nothing in it
    for g in grads:
        theirs = torch.empty_like(g)
        ops = [dist.P2POp(dist.isend, g.clone(), 1 - rank), dist.P2POp(dist.irecv, theirs, 1 - rank)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        g.add_(theirs).div_(world_size)
""",
    "from-imported all_reduce, once per parameter": """
from torch.distributed import all_reduce


def average_gradients_flat(model):
    for p in model.parameters():
        all_reduce(p.grad)
        p.grad /= world_size
""",
    "all_gather of every rank's gradients, averaged locally": """
def average_gradients_flat(model):
    flat = torch.cat([p.grad.flatten() for p in model.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(everyone, flat)
    flat = torch.stack(everyone).mean(0)
    offset = 0
    for p in model.parameters():
        p.grad.copy_(flat[offset:offset + p.grad.numel()].view_as(p.grad))
        offset += p.grad.numel()
""",
}

FLAT_RIGHT_OTHER = """
from torch.nn.utils import parameters_to_vector, vector_to_parameters


def average_gradients_flat(model):
    params = list(model.parameters())
    flat = parameters_to_vector([p.grad for p in params]) / world_size  # divided before the sum
    dist.all_reduce(flat)
    grads = [torch.empty_like(p) for p in params]
    vector_to_parameters(flat, grads)
    for p, g in zip(params, grads):
        p.grad.copy_(g)
"""

WEIGHTED_RIGHT_OTHER = """
def average_gradients_weighted(model, n_local):
    total = torch.tensor([float(n_local)], device=device)
    dist.all_reduce(total)                 # samples on all ranks together
    for p in model.parameters():
        p.grad *= n_local                  # mean over my shard -> sum over my shard
        dist.all_reduce(p.grad)            # sum over all samples
        p.grad /= total                    # mean over all samples
"""


def lesson05_setup(ip):
    for text in ("X_full, y_full = make_data()", "X = X_all.tensor_split"):  # make_data, make_model, X, y
        on_ranks(ip, lesson_cell("05_distributed_sgd", text))


@pytest.mark.parametrize("wrong", list(FLAT_WRONG))
def test_05_flat_refuses_wrong_methods(ip, cluster, wrong):
    lesson05_setup(ip)
    assert_checker(ip, "05_distributed_sgd", 1, FLAT_WRONG[wrong], 2)


@pytest.mark.parametrize(("exercise", "answer"), [(1, FLAT_RIGHT_OTHER), (2, WEIGHTED_RIGHT_OTHER)])
def test_05_checkers_accept_other_right_answers(ip, cluster, exercise, answer):
    lesson05_setup(ip)
    checker = lesson_cell("05_distributed_sgd", f"# Checker for exercise {exercise}")
    text = on_ranks(ip, answer + "\n" + checker)
    assert f"exercise {exercise}: pass" in text and "not yet" not in text, text


def test_05_run_all_checks_the_learners_answers(ip, cluster):
    for text in ("X_full, y_full = make_data()", "X = X_all.tensor_split"):
        on_ranks(ip, lesson_cell("05_distributed_sgd", text))
    summed = """
def average_gradients_flat(model):
    flat = torch.cat([p.grad.flatten() for p in model.parameters()])
    dist.all_reduce(flat)  # summed, never divided by world_size
    offset = 0
    for p in model.parameters():
        p.grad.copy_(flat[offset:offset + p.grad.numel()].view_as(p.grad))
        offset += p.grad.numel()
"""
    assert_run_all(ip, "05_distributed_sgd", {1: summed, 2: WEIGHTED_WRONG["total written in by hand"]}, 2)
