"""Lesson 11's checkers refuse wrong answers (some right in value, wrong in method) and pass right ones.

Runs, on the module's 2-rank gloo cluster, the lesson's helper cells the checkers need (``wrap``,
``make_mlp``, ``counting_hook``, ``contextlib``, ``F``), then each wrong solution and the reference
solution followed by the lesson's checker cell, and other right solutions.
"""

from __future__ import annotations

import pytest

from tests.checker_harness import assert_checker, assert_run_all, check, lesson_cell, on_ranks
from tests.conftest import running_cluster

LESSON = "11_ddp_internals_and_bandwidth"

WRONG = {
    (1, "every bucket counted, the last one too"): """
import math
def min_tokens_to_hide(n_params, bytes_per_grad, world_size, busbw, alpha, flops, bucket, first_bucket):
    total = n_params * bytes_per_grad
    buckets = 1 + math.ceil(max(total - first_bucket, 0) / bucket)
    n = world_size
    return math.ceil((buckets * alpha + 2 * (n - 1) / n * total / busbw) / (4 * n_params / flops) - 1e-9)
""",
    (1, "the last bucket taken as a full one"): """
import math
def min_tokens_to_hide(n_params, bytes_per_grad, world_size, busbw, alpha, flops, bucket, first_bucket):
    total = n_params * bytes_per_grad
    buckets = 1 + math.ceil(max(total - first_bucket, 0) / bucket)
    hidden = max(total - (bucket if buckets > 1 else total), 0)
    n = world_size
    seconds = (buckets - 1) * alpha + 2 * (n - 1) / n * hidden / busbw
    return math.ceil(seconds / (4 * n_params / flops) - 1e-9)
""",
    (1, "algorithm bandwidth: no 2(n-1)/n"): """
import math
def min_tokens_to_hide(n_params, bytes_per_grad, world_size, busbw, alpha, flops, bucket, first_bucket):
    total = n_params * bytes_per_grad
    first = min(total, first_bucket)
    buckets = 1 + math.ceil((total - first) / bucket)
    last = total - first - (buckets - 2) * bucket if buckets > 1 else first
    return math.ceil(((buckets - 1) * alpha + (total - last) / busbw) / (4 * n_params / flops) - 1e-9)
""",
    (1, "rounded down"): """
import math
def min_tokens_to_hide(n_params, bytes_per_grad, world_size, busbw, alpha, flops, bucket, first_bucket):
    total = n_params * bytes_per_grad
    first = min(total, first_bucket)
    buckets = 1 + math.ceil((total - first) / bucket)
    last = total - first - (buckets - 2) * bucket if buckets > 1 else first
    n = world_size
    seconds = (buckets - 1) * alpha + 2 * (n - 1) / n * (total - last) / busbw
    return math.floor(seconds / (4 * n_params / flops))
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
    (3, "every rank's whole gradient gathered (a list: its size must count)"): """
def sharded_clipped_sgd_step(flat_param, flat_grad, lr, max_norm):
    everyone = [torch.empty_like(flat_grad) for _ in range(world_size)]
    dist.all_gather(everyone, flat_grad)
    full = torch.stack(everyone).mean(0)
    scale = min(1.0, max_norm / (full.norm().item() + 1e-6))
    shard = flat_param.numel() // world_size
    mine = slice(rank * shard, (rank + 1) * shard)
    dist.all_gather_single(flat_param, flat_param[mine] - lr * scale * full[mine])
""",
    (3, "the gradient all-reduced as a coalesced list"): """
import warnings
def sharded_clipped_sgd_step(flat_param, flat_grad, lr, max_norm):
    full = flat_grad / world_size
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dist.all_reduce_coalesced([full])
    scale = min(1.0, max_norm / (full.norm().item() + 1e-6))
    shard = flat_param.numel() // world_size
    mine = slice(rank * shard, (rank + 1) * shard)
    dist.all_gather_single(flat_param, flat_param[mine] - lr * scale * full[mine])
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
    (1, "bucket by bucket, in a loop"): """
def min_tokens_to_hide(n_params, bytes_per_grad, world_size, busbw, alpha, flops, bucket, first_bucket):
    left, sizes, cap = n_params * bytes_per_grad, [], first_bucket
    while left > 0:
        sizes.append(min(cap, left))
        left, cap = left - sizes[-1], bucket
    factor = 2 * (world_size - 1) / world_size
    hidden = sum(alpha + factor * size / busbw for size in sizes[:-1])
    tokens = hidden * flops / (4 * n_params)
    return int(tokens) + (tokens > int(tokens))
""",
    (2, "all parameters averaged in one coalesced call"): """
import warnings
def local_sgd_step(ddp, opt, x, y, step, k):
    with ddp.no_sync():
        opt.zero_grad()
        F.mse_loss(ddp(x), y).backward()
    opt.step()
    if (step + 1) % k == 0:
        params = list(ddp.parameters())
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dist.all_reduce_coalesced(params)
            for p in params:
                p.div_(world_size)
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


# right on 2 ranks only: world size 2 written in
TWO_RANKS = {
    2: """
def local_sgd_step(ddp, opt, x, y, step, k):
    with ddp.no_sync():
        opt.zero_grad()
        F.mse_loss(ddp(x), y).backward()
    opt.step()
    if (step + 1) % k == 0:
        with torch.no_grad():
            for p in ddp.parameters():
                dist.all_reduce(p)
                p.div_(2)
""",
    3: """
def sharded_clipped_sgd_step(flat_param, flat_grad, lr, max_norm):
    shard = flat_param.numel() // world_size
    grad = torch.empty(shard, device=flat_grad.device)
    dist.reduce_scatter_single(grad, flat_grad / 2)  # the mean over the 2 ranks it was written on
    squares = grad.pow(2).sum().reshape(1)
    dist.all_reduce(squares)
    scale = min(1.0, max_norm / (squares.sqrt().item() + 1e-6))
    mine = flat_param[rank * shard : (rank + 1) * shard] - lr * scale * grad
    dist.all_gather_single(flat_param, mine)
""",
}


def test_11_checkers_on_four_ranks(ip):
    """Exercises 2 and 3 on 4 ranks: an answer with world size 2 written in is refused, the reference passes.
    First in the module: the module's 2-rank cluster starts with the next test."""
    with running_cluster(ip, 4):
        on_ranks(ip, lesson_cell(LESSON, "def slowest_median("))
        on_ranks(ip, lesson_cell(LESSON, "def counting_hook(").split("results = {}")[0])
        for exercise, wrong in TWO_RANKS.items():
            assert_checker(ip, LESSON, exercise, wrong, 4)


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


@pytest.mark.parametrize("exercise", list(TWO_RANKS))
def test_11_two_rank_answers_pass_on_two_ranks(ip, cluster, helpers, exercise):
    """What test_11_checkers_on_four_ranks refuses is right on 2 ranks: only 4 ranks tell it apart."""
    assert set(check(ip, LESSON, exercise, TWO_RANKS[exercise], 2).values()) == {"pass"}
