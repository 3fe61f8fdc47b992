"""Lesson 11's checkers refuse wrong answers (some right in value, wrong in method) and pass right ones.

Runs, on the module's 2-rank gloo cluster, the lesson's helper cells the checkers need (``wrap``,
``make_mlp``, ``counting_hook``, ``contextlib``, ``F``), then each wrong solution and the reference
solution followed by the lesson's checker cell, and other right solutions.
"""

from __future__ import annotations

import pytest

from tests.checker_harness import assert_checker, assert_run_all, check, lesson_cell, on_ranks

LESSON = "11_ddp_internals_and_bandwidth"

WRONG = {
    (1, "algorithm bandwidth: S / busbw"): """
import math
def min_tokens_to_hide(n_params, bytes_per_grad, world_size, busbw, flops):
    return math.ceil(n_params * bytes_per_grad / busbw / (4 * n_params / flops))
""",
    (1, "2 S / busbw, right only for many ranks"): """
import math
def min_tokens_to_hide(n_params, bytes_per_grad, world_size, busbw, flops):
    return math.ceil(2 * n_params * bytes_per_grad / busbw / (4 * n_params / flops)) if world_size > 1 else 0
""",
    (1, "forward and backward (6 FLOPs) counted"): """
import math
def min_tokens_to_hide(n_params, bytes_per_grad, world_size, busbw, flops):
    n = world_size
    return math.ceil(2 * (n - 1) / n * n_params * bytes_per_grad / busbw / (6 * n_params / flops))
""",
    (2, "gradients averaged by DDP every step"): """
def local_sgd_step(ddp, opt, x, y, step, k):
    opt.zero_grad()
    F.mse_loss(ddp(x), y).backward()
    opt.step()
""",
    (2, "parameters averaged every step"): """
def local_sgd_step(ddp, opt, x, y, step, k):
    with ddp.no_sync():
        opt.zero_grad()
        F.mse_loss(ddp(x), y).backward()
    opt.step()
    with torch.no_grad():
        for p in ddp.parameters():
            dist.all_reduce(p)
            p.div_(world_size)
""",
    (2, "parameters summed, not averaged"): """
def local_sgd_step(ddp, opt, x, y, step, k):
    with ddp.no_sync():
        opt.zero_grad()
        F.mse_loss(ddp(x), y).backward()
    opt.step()
    if (step + 1) % k == 0:
        with torch.no_grad():
            for p in ddp.parameters():
                dist.all_reduce(p)
""",
    (2, "gradients all-reduced by hand at step k"): """
def local_sgd_step(ddp, opt, x, y, step, k):
    with ddp.no_sync():
        opt.zero_grad()
        F.mse_loss(ddp(x), y).backward()
    if (step + 1) % k == 0:
        for p in ddp.parameters():
            dist.all_reduce(p.grad)
            p.grad.div_(world_size)
    opt.step()
""",
    (3, "the whole gradient all-reduced for its norm"): """
def sharded_clipped_sgd_step(flat_param, flat_grad, lr, max_norm):
    full = flat_grad / world_size
    dist.all_reduce(full)
    scale = min(1.0, max_norm / (full.norm().item() + 1e-6))
    shard = flat_param.numel() // world_size
    mine = slice(rank * shard, (rank + 1) * shard)
    dist.all_gather_single(flat_param, flat_param[mine] - lr * scale * full[mine])
""",
    (3, "each shard clipped by its own norm"): """
def sharded_clipped_sgd_step(flat_param, flat_grad, lr, max_norm):
    shard = flat_param.numel() // world_size
    grad = torch.empty(shard, device=flat_grad.device)
    dist.reduce_scatter_single(grad, flat_grad / world_size)
    scale = min(1.0, max_norm / (grad.norm().item() + 1e-6))
    mine = flat_param[rank * shard : (rank + 1) * shard] - lr * scale * grad
    dist.all_gather_single(flat_param, mine)
""",
    (3, "summed, not averaged"): """
def sharded_clipped_sgd_step(flat_param, flat_grad, lr, max_norm):
    shard = flat_param.numel() // world_size
    grad = torch.empty(shard, device=flat_grad.device)
    dist.reduce_scatter_single(grad, flat_grad)
    squares = grad.pow(2).sum().reshape(1)
    dist.all_reduce(squares)
    scale = min(1.0, max_norm / (squares.sqrt().item() + 1e-6))
    mine = flat_param[rank * shard : (rank + 1) * shard] - lr * scale * grad
    dist.all_gather_single(flat_param, mine)
""",
}

RIGHT_OTHERWISE = {
    (1, "n_params cancelled by hand, floats"): """
import math
def min_tokens_to_hide(n_params, bytes_per_grad, world_size, busbw, flops):
    return float(math.ceil((world_size - 1) / world_size * bytes_per_grad * flops / (2 * busbw)))
""",
    (2, "torch's PeriodicModelAverager on the module itself"): """
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
averagers = {}
def local_sgd_step(ddp, opt, x, y, step, k):
    averager = averagers.setdefault(id(ddp), PeriodicModelAverager(period=k, warmup_steps=k - 1))
    opt.zero_grad()
    F.mse_loss(ddp.module(x), y).backward()  # the module alone: no reducer at all
    opt.step()
    averager.average_parameters(ddp.parameters())
""",
    (3, "old names, and the shards' norms gathered"): """
import warnings
def sharded_clipped_sgd_step(flat_param, flat_grad, lr, max_norm):
    shard = flat_param.numel() // world_size
    grad = torch.empty(shard, device=flat_grad.device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        dist.reduce_scatter_tensor(grad, flat_grad / world_size)
        norms = torch.empty(world_size, device=flat_grad.device)
        dist.all_gather_into_tensor(norms, grad.norm().reshape(1))
        scale = min(1.0, max_norm / (norms.pow(2).sum().sqrt().item() + 1e-6))
        mine = flat_param[rank * shard : (rank + 1) * shard] - lr * scale * grad
        dist.all_gather_into_tensor(flat_param, mine)
""",
}


@pytest.fixture(scope="module")
def helpers(ip, cluster):
    """The lesson's helper cell and its counting comm hook on the ranks."""
    on_ranks(ip, lesson_cell(LESSON, "def slowest_median("))
    on_ranks(ip, lesson_cell(LESSON, "def counting_hook(").split("results = {}")[0])


@pytest.mark.parametrize("exercise, wrong", list(WRONG), ids=[f"{e}-{w}" for e, w in WRONG])
def test_11_checkers_refuse(ip, cluster, helpers, exercise, wrong):
    assert_checker(ip, LESSON, exercise, WRONG[exercise, wrong], 2)


@pytest.mark.parametrize(
    "exercise, right", list(RIGHT_OTHERWISE), ids=[f"{e}-{r}" for e, r in RIGHT_OTHERWISE]
)
def test_11_checkers_accept_other_right_answers(ip, cluster, helpers, exercise, right):
    assert set(check(ip, LESSON, exercise, RIGHT_OTHERWISE[exercise, right], 2).values()) == {"pass"}


def test_11_run_all_checks_the_learners_answers(ip, cluster, helpers):
    first = {exercise: WRONG[exercise, name] for exercise, name in reversed(WRONG)}
    assert_run_all(ip, LESSON, first, 2)
