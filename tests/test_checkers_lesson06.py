"""Lesson 06's exercise checkers refuse wrong answers and pass the reference solutions
(tests/checker_harness.py says how)."""

from __future__ import annotations

import pytest

from tests.checker_harness import assert_checker, assert_run_all, lesson_cell, on_ranks
from tests.conftest import running_cluster

# lesson 06: the loss for uneven shards under DDP; a comm hook of your own that halves the traffic

WORLD_SIZE_WRITTEN_AS_TWO = {  # right on the lesson's 2 ranks, wrong on 4
    1: """
def shard_loss(output, target):
    count = torch.tensor(float(target.numel()), device=target.device)
    dist.all_reduce(count)
    return F.mse_loss(output, target, reduction="sum") * 2 / count
""",
    2: """
def half_traffic_hook(state, bucket):
    grads = bucket.buffer()
    small = (grads / 2).to(torch.float16)
    work = dist.all_reduce(small, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0].to(grads.dtype))
""",
}


def test_06_checkers_at_four_ranks_refuse_a_world_size_written_in(ip):
    """Runs first, before the module's 2-rank cluster starts: the checkers at another world size."""
    with running_cluster(ip, 4):
        on_ranks(ip, lesson_cell("06_ddp", "def wrap("))  # make_data, make_model, wrap, the shards X, y
        for exercise, wrong in WORLD_SIZE_WRITTEN_AS_TWO.items():
            assert_checker(ip, "06_ddp", exercise, wrong, 4)

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


SHARD_LOSS_RIGHT_OTHER = """
def shard_loss(output, target):
    counts = [torch.zeros(1, device=target.device) for _ in range(world_size)]
    dist.all_gather(counts, torch.tensor([float(target.numel())], device=target.device))
    total = torch.cat(counts).sum()  # every rank's count, added up locally
    return (output - target).pow(2).sum() / (total / world_size)
"""


def test_06_shard_loss_accepts_another_right_answer(ip, cluster):
    on_ranks(ip, lesson_cell("06_ddp", "def wrap("))
    text = on_ranks(ip, SHARD_LOSS_RIGHT_OTHER + "\n" + lesson_cell("06_ddp", "# Checker for exercise 1"))
    assert "exercise 1: pass" in text and "not yet" not in text, text


HOOK_WRONG = {
    "torch's built-in fp16 hook": """
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks


def half_traffic_hook(state, bucket):
    return default_hooks.fp16_compress_hook(dist.group.WORLD, bucket)
""",
    "float32, the full traffic": """
def half_traffic_hook(state, bucket):
    grads = bucket.buffer() / world_size
    return dist.all_reduce(grads, async_op=True).get_future().then(lambda fut: fut.value()[0])
""",
    "half of the values sent, the other half kept local": """
def half_traffic_hook(state, bucket):
    grads = bucket.buffer()
    grads /= world_size
    half = grads[: grads.numel() // 2 + grads.numel() % 2].clone()
    def put_back(fut):
        grads[: half.numel()] = fut.value()[0]
        return grads
    return dist.all_reduce(half, async_op=True).get_future().then(put_back)
""",
    "a token all_reduce, the bucket sent whole by all_gather": """
def half_traffic_hook(state, bucket):
    grads = bucket.buffer()
    dist.all_reduce(torch.zeros(1))  # an all_reduce for the record
    everyone = [torch.empty_like(grads) for _ in range(world_size)]
    dist.all_gather(everyone, grads)  # the real traffic, float32
    grads.copy_(torch.stack(everyone).mean(0))
    fut = torch.futures.Future()
    fut.set_result(grads)
    return fut
""",
    "a token float16 all_reduce, the bucket sent whole point to point": """
def half_traffic_hook(state, bucket):
    grads = bucket.buffer()
    dist.all_reduce(torch.zeros(1, dtype=torch.float16))  # a collective for the record
    theirs = torch.empty_like(grads)
    ops = [dist.P2POp(dist.isend, grads, 1 - rank), dist.P2POp(dist.irecv, theirs, 1 - rank)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    grads.add_(theirs).div_(world_size)
    fut = torch.futures.Future()
    fut.set_result(grads)
    return fut
""",
    "float16 without the division": """
def half_traffic_hook(state, bucket):
    small = bucket.buffer().to(torch.float16)
    return dist.all_reduce(small, async_op=True).get_future().then(lambda fut: fut.value()[0].float())
""",
}

HOOK_RIGHT_OTHER = """
def half_traffic_hook(state, bucket):
    grads = bucket.buffer()
    small = grads.to(torch.bfloat16)       # another 2-byte type; divide after the reduction
    work = dist.all_reduce(small, async_op=True)
    def average(fut):
        grads.copy_(fut.value()[0])
        return grads.div_(world_size)
    return work.get_future().then(average)
"""


@pytest.mark.parametrize("wrong", list(HOOK_WRONG))
def test_06_half_traffic_hook_refuses_wrong_methods(ip, cluster, wrong):
    on_ranks(ip, lesson_cell("06_ddp", "def wrap("))  # make_data, make_model, wrap, the shards X, y
    assert_checker(ip, "06_ddp", 2, HOOK_WRONG[wrong], 2)


def test_06_half_traffic_hook_accepts_another_right_answer(ip, cluster):
    on_ranks(ip, lesson_cell("06_ddp", "def wrap("))
    text = on_ranks(ip, HOOK_RIGHT_OTHER + "\n" + lesson_cell("06_ddp", "# Checker for exercise 2"))
    assert "exercise 2: pass" in text and "not yet" not in text, text


def test_06_run_all_checks_the_learners_answers(ip, cluster):
    on_ranks(ip, lesson_cell("06_ddp", "def wrap("))
    wrong = {1: SHARD_LOSS_WRONG["each rank's plain mean"], 2: HOOK_WRONG["torch's built-in fp16 hook"]}
    assert_run_all(ip, "06_ddp", wrong, 2)
