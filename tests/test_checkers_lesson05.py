"""Lesson 05's exercise checkers refuse wrong answers and pass the reference solutions
(tests/checker_harness.py says how)."""

from __future__ import annotations

import pytest

from tests.checker_harness import assert_checker, assert_run_all, lesson_cell, on_ranks

# lesson 05: weighted average through all_reduce

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
}


@pytest.mark.parametrize("wrong", list(WEIGHTED_WRONG))
def test_05_weighted_average_must_communicate(ip, cluster, wrong):
    for text in ("X_full, y_full = make_data()", "X = X_all.tensor_split"):  # make_data, make_model, X, y
        on_ranks(ip, lesson_cell("05_distributed_sgd", text))
    assert_checker(ip, "05_distributed_sgd", 2, WEIGHTED_WRONG[wrong], 2)


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
