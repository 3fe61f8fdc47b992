"""Lesson 06's exercise checkers refuse wrong answers and pass the reference solutions
(tests/checker_harness.py says how)."""

from __future__ import annotations

import pytest

from tests.checker_harness import assert_checker, assert_run_all, lesson_cell, on_ranks

# lesson 06: the loss for uneven shards under DDP; your own comm hook, not the built-in one

SHARD_LOSS_WRONG = {
    "each rank's plain mean": """
def shard_loss(output, target):
    return F.mse_loss(output, target)  # every rank weighs the same, whatever its number of rows
""",
    "sum over the global count, not scaled by world_size": """
def shard_loss(output, target):
    count = torch.tensor(float(target.numel()), device=target.device)
    dist.all_reduce(count)
    return F.mse_loss(output, target, reduction="sum") / count  # DDP divides by world_size once more
""",
    "total written in by hand": """
def shard_loss(output, target):
    return F.mse_loss(output, target, reduction="sum") * world_size / 16  # right only for 16 rows
""",
    "weighted by the local count only": """
def shard_loss(output, target):
    return F.mse_loss(output, target) * len(target)  # never divided by the total
""",
    "not a loss": """
def shard_loss(output, target):
    return (output - target).pow(2).sum().item()
""",
}

NOT_YET_BECAUSE = {
    "each rank's plain mean": "plain average of the ranks' mean losses",
    "sum over the global count, not scaled by world_size": "0.5 times the full-batch ones",
    "total written in by hand": "right for 16 rows but not for 10",
    "weighted by the local count only": "differ from one process's F.mse_loss",
    "not a loss": "should return a scalar tensor",
}


@pytest.mark.parametrize("wrong", list(SHARD_LOSS_WRONG))
def test_06_shard_loss_weighs_ranks_by_their_rows(ip, cluster, wrong):
    on_ranks(ip, lesson_cell("06_ddp", "def wrap("))  # make_data, make_model, wrap, the shards X, y
    on_ranks(ip, SHARD_LOSS_WRONG[wrong])
    text = on_ranks(ip, lesson_cell("06_ddp", "# Checker for exercise 1"))
    assert NOT_YET_BECAUSE[wrong] in text, text  # the checker says what is wrong
    assert_checker(ip, "06_ddp", 1, SHARD_LOSS_WRONG[wrong], 2)


HOOK_WRONG = {
    "built-in allreduce_hook": """
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks


def mean_hook(state, bucket):
    return default_hooks.allreduce_hook(state, bucket)
""",
    "built-in allreduce_hook renamed": """
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook as mean_hook
""",
}


@pytest.mark.parametrize("wrong", list(HOOK_WRONG))
def test_06_comm_hook_must_be_your_own(ip, cluster, wrong):
    on_ranks(ip, lesson_cell("06_ddp", "def wrap("))  # make_data, make_model, wrap, the shards X, y
    assert_checker(ip, "06_ddp", 2, HOOK_WRONG[wrong], 2)


def test_06_run_all_checks_the_learners_answers(ip, cluster):
    on_ranks(ip, lesson_cell("06_ddp", "def wrap("))
    wrong = {1: SHARD_LOSS_WRONG["each rank's plain mean"], 2: HOOK_WRONG["built-in allreduce_hook"]}
    assert_run_all(ip, "06_ddp", wrong, 2)
