"""Lesson 11's exercise checkers fail the obvious wrong answers and pass the reference solutions.

Runs, on the module's 2-rank gloo cluster, the lesson's helper cells the checkers need (``wrap``,
``make_mlp``, ``counting_hook``, ``contextlib``, ``F``), then each wrong solution and the reference
solution followed by the lesson's checker cell (see ``tests/test_checkers.py``).
"""

from __future__ import annotations

import pytest

from tests.checker_harness import assert_checker, assert_run_all, lesson_cell, on_ranks

LESSON = "11_ddp_internals_and_bandwidth"

WRONG = {
    (1, "all_reduce's factor for every collective"): """
def bus_bandwidth(collective, n_bytes, seconds, world_size):
    return n_bytes / seconds * 2 * (world_size - 1) / world_size / 1e9
""",
    (1, "algorithm bandwidth"): """
def bus_bandwidth(collective, n_bytes, seconds, world_size):
    return n_bytes / seconds / 1e9
""",
    (1, "the lesson's table, not written by the learner"): """
def bus_bandwidth(collective, n_bytes, seconds, world_size):
    return n_bytes / seconds * BUS_FACTOR[collective](world_size) / 1e9
""",
    (2, "synchronises every micro-batch"): """
def accumulate(ddp, micro_batches):
    for x, y in micro_batches:
        F.mse_loss(ddp(x), y).backward()
""",
    (2, "no_sync everywhere: never averaged"): """
def accumulate(ddp, micro_batches):
    with ddp.no_sync():
        for x, y in micro_batches:
            F.mse_loss(ddp(x), y).backward()
""",
    (2, "only the last micro-batch"): """
def accumulate(ddp, micro_batches):
    x, y = micro_batches[-1]
    F.mse_loss(ddp(x), y).backward()
""",
    (3, "all_reduce and a full update, as DDP does"): """
def sharded_momentum_step(flat_param, flat_grad, momentum, lr, beta):
    grad = flat_grad / world_size
    dist.all_reduce(grad)
    shard = momentum.numel()
    momentum.mul_(beta).add_(grad[rank * shard : (rank + 1) * shard])
    flat_param -= lr * torch.cat([momentum] * world_size)  # wrong for the other shards anyway
""",
    (3, "summed, not averaged"): """
def sharded_momentum_step(flat_param, flat_grad, momentum, lr, beta):
    shard = momentum.numel()
    grad = torch.empty(shard, device=flat_grad.device)
    dist.reduce_scatter_tensor(grad, flat_grad)
    momentum.mul_(beta).add_(grad)
    mine = flat_param[rank * shard : (rank + 1) * shard] - lr * momentum
    dist.all_gather_into_tensor(flat_param, mine)
""",
    (3, "momentum not kept between steps"): """
def sharded_momentum_step(flat_param, flat_grad, momentum, lr, beta):
    shard = momentum.numel()
    grad = torch.empty(shard, device=flat_grad.device)
    dist.reduce_scatter_tensor(grad, flat_grad / world_size)
    mine = flat_param[rank * shard : (rank + 1) * shard] - lr * (beta * momentum + grad)
    dist.all_gather_into_tensor(flat_param, mine)
""",
}


@pytest.fixture(scope="module")
def helpers(ip, cluster):
    """The lesson's helper cell, its counting comm hook and its table of bus factors on the ranks."""
    on_ranks(ip, lesson_cell(LESSON, "def slowest_median("))
    on_ranks(ip, lesson_cell(LESSON, "def counting_hook(").split("results = {}")[0])
    table = lesson_cell(LESSON, "BUS_FACTOR = {").split("print(")[0]
    on_ranks(ip, table)


@pytest.mark.parametrize("exercise, wrong", list(WRONG), ids=[f"{e}-{w}" for e, w in WRONG])
def test_11_checkers(ip, cluster, helpers, exercise, wrong):
    assert_checker(ip, LESSON, exercise, WRONG[exercise, wrong], 2)


def test_11_run_all_checks_the_learners_answers(ip, cluster, helpers):
    first = {exercise: WRONG[exercise, name] for exercise, name in reversed(WRONG)}
    assert_run_all(ip, LESSON, first, 2)
