"""Lesson 13's checkers refuse wrong answers and wrong methods, pass the reference and other right answers.

On a real gloo cluster of 3 ranks (the lesson's exercises run on the three ranks left after its torchft
section), with the lesson's training job defined on every rank, the lesson's own checker cell runs after a
wrong solution (every rank must print ``not yet``), after the lesson's reference solution and after another
right solution (every rank ``pass``). The checkers judge the method with ``ddp_magics.lessons.c10d_watch``,
which sees every c10d op however it was called (functional collectives and ``ProcessGroup`` methods too): how
many collective operations the answer ran and how many numbers each rank put in; and with
``ddp_magics.lessons.watch``: no pickled objects.
"""

from __future__ import annotations

import pytest

from tests.checker_harness import assert_checker, assert_run_all, check, lesson_cell, on_ranks
from tests.conftest import running_cluster

LESSON = "13_fault_tolerance"
WORLD = 3


@pytest.fixture(scope="module")
def lesson_ranks(ip):
    """3 ranks holding the lesson's job (``X``, ``nn``, ``shard``, ``model``, ...), run from its
    ``%%writefile`` cell's code."""
    with running_cluster(ip, WORLD) as magics:
        job = lesson_cell(LESSON, '"""Lesson 13\'s training job')
        assert job.startswith("%%writefile job13.py\n")
        on_ranks(ip, job.partition("\n")[2])
        yield magics


def assert_accepted(ip, exercise: int, answer: str) -> None:
    assert set(check(ip, LESSON, exercise, answer, WORLD).values()) == {"pass"}


# exercise 1: the ranks whose state differs from rank src's, from a fingerprint of at most 16 numbers

DRIFT_WRONG = {
    "the whole state gathered as pickled objects (right value, wrong method)": """
def ranks_out_of_sync(model, src):
    every = [None] * world_size
    dist.all_gather_object(every, {k: v.clone() for k, v in model.state_dict().items()})
    return [r for r in range(world_size)
            if any(not torch.equal(every[r][k], every[src][k]) for k in every[src])]
""",
    "every value gathered as one tensor (right value, thousands of numbers)": """
def ranks_out_of_sync(model, src):
    flat = torch.cat([t.detach().reshape(-1).double() for t in model.state_dict().values()])
    every = [torch.zeros_like(flat) for _ in range(world_size)]
    dist.all_gather(every, flat)
    return [r for r in range(world_size) if not torch.equal(every[r], every[src])]
""",
    "a plain sum of the values (blind to two values swapped)": """
def ranks_out_of_sync(model, src):
    total = torch.tensor([sum(t.double().sum().item() for t in model.state_dict().values())],
                         dtype=torch.float64)
    every = [torch.zeros_like(total) for _ in range(world_size)]
    dist.all_gather(every, total)
    return [r for r in range(world_size) if not torch.equal(every[r], every[src])]
""",
    "parameters only (blind to the buffers)": """
import hashlib


def ranks_out_of_sync(model, src):
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().reshape(-1).view(torch.uint8).numpy().tobytes())
    mine = torch.tensor([int.from_bytes(digest.digest()[:8], "little", signed=True)])
    every = [torch.zeros_like(mine) for _ in range(world_size)]
    dist.all_gather(every, mine)
    return [r for r in range(world_size) if not torch.equal(every[r], every[src])]
""",
    "one broadcast of a digest from every rank (right value, too many calls)": """
import hashlib


def ranks_out_of_sync(model, src):
    digest = hashlib.sha256()
    for name, t in model.state_dict().items():
        digest.update(name.encode())
        digest.update(t.detach().reshape(-1).view(torch.uint8).numpy().tobytes())
    mine = torch.tensor([int.from_bytes(digest.digest()[:8], "little", signed=True)])
    every = []
    for r in range(world_size):
        value = mine.clone()
        dist.broadcast(value, src=r)
        every.append(value)
    return [r for r in range(world_size) if not torch.equal(every[r], every[src])]
""",
    "the whole state gathered by a functional all-gather (thousands of numbers, past torch.distributed)": """
import torch.distributed._functional_collectives as funcol


def ranks_out_of_sync(model, src):
    flat = torch.cat([t.detach().reshape(-1).double() for t in model.state_dict().values()])
    every = funcol.all_gather_tensor(flat, 0, dist.group.WORLD).wait().chunk(world_size)
    return [r for r in range(world_size) if not torch.equal(every[r], every[src])]
""",
    "the whole state gathered by the ProcessGroup's own allgather (thousands of numbers)": """
def ranks_out_of_sync(model, src):
    flat = torch.cat([t.detach().reshape(-1).double() for t in model.state_dict().values()])
    every = [torch.zeros_like(flat) for _ in range(world_size)]
    dist.group.WORLD.allgather([every], [flat]).wait()
    return [r for r in range(world_size) if not torch.equal(every[r], every[src])]
""",
    "a sample of 15 values at the front of the tensors (blind to the rest)": """
def ranks_out_of_sync(model, src):
    state = model.state_dict()
    sample = torch.cat([state["0.weight"].reshape(-1)[:6], state["1.running_var"][:8],
                        state["1.num_batches_tracked"].reshape(1).double()]).double()
    every = [torch.zeros_like(sample) for _ in range(world_size)]
    dist.all_gather(every, sample)
    return [r for r in range(world_size) if not torch.equal(every[r], every[src])]
""",
}

DRIFT_OTHER_RIGHT = {
    "a position-weighted sum of the bytes, in one all_gather_into_tensor": """
def ranks_out_of_sync(model, src):
    total, offset = 0, 0
    for t in model.state_dict().values():
        raw = t.detach().reshape(-1).view(torch.uint8).reshape(-1).to(torch.int64)
        total += int((raw * torch.arange(offset + 1, offset + raw.numel() + 1)).sum())
        offset += raw.numel()
    mine = torch.tensor([total], dtype=torch.int64)
    every = torch.zeros(world_size, dtype=torch.int64)
    dist.all_gather_into_tensor(every, mine)
    return sorted(r for r in range(world_size) if every[r] != every[src])
""",
    "src's digest broadcast, then each rank's verdict gathered": """
import zlib


def ranks_out_of_sync(model, src):
    crc = 0
    for name, t in model.state_dict().items():
        crc = zlib.crc32(name.encode() + t.detach().reshape(-1).view(torch.uint8).numpy().tobytes(), crc)
    theirs = torch.tensor([crc], dtype=torch.int64)
    dist.broadcast(theirs, src=src)
    differs = torch.tensor([int(theirs.item() != crc)])
    flags = [torch.zeros_like(differs) for _ in range(world_size)]
    dist.all_gather(flags, differs)
    return [r for r, flag in enumerate(flags) if flag.item()]
""",
}


@pytest.mark.parametrize("wrong", list(DRIFT_WRONG))
def test_13_drift_refuses_wrong_values_and_wrong_methods(ip, lesson_ranks, wrong):
    assert_checker(ip, LESSON, 1, DRIFT_WRONG[wrong], WORLD)


@pytest.mark.parametrize("right", list(DRIFT_OTHER_RIGHT))
def test_13_drift_accepts_other_right_answers(ip, lesson_ranks, right):
    assert_accepted(ip, 1, DRIFT_OTHER_RIGHT[right])


# exercise 2: every rank stops at the first step at which any rank noticed, inside the gradient all-reduce

STOP_WRONG = {
    "the gradient only, each rank its own notice (the ranks disagree)": """
def should_stop(noticed, grad):
    dist.all_reduce(grad)
    return noticed
""",
    "the gradient, then the flags' MAX (right value, a second collective every step)": """
def should_stop(noticed, grad):
    dist.all_reduce(grad)
    flag = torch.tensor([int(noticed)])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())
""",
    "gradient and flag packed, reduced with MAX (the gradient is not summed)": """
def should_stop(noticed, grad):
    packed = torch.cat([grad.reshape(-1), torch.tensor([float(noticed)])])
    dist.all_reduce(packed, op=dist.ReduceOp.MAX)
    grad.copy_(packed[:-1].view_as(grad))
    return bool(packed[-1] > 0)
""",
    "rank 0's flag packed (misses the other ranks' notices)": """
def should_stop(noticed, grad):
    packed = torch.cat([grad.reshape(-1), torch.tensor([float(noticed and rank == 0)])])
    dist.all_reduce(packed)
    grad.copy_(packed[:-1].view_as(grad))
    return bool(packed[-1] > 0)
""",
    "a one-hot vector of world_size flags packed (right value, too many numbers)": """
def should_stop(noticed, grad):
    flags = torch.zeros(world_size)
    flags[rank] = float(noticed)
    packed = torch.cat([grad.reshape(-1), flags])
    dist.all_reduce(packed)
    grad.copy_(packed[:grad.numel()].view_as(grad))
    return bool(packed[grad.numel():].sum() > 0)
""",
    "a barrier, then a functional all-reduce of the packed buffer (two operations)": """
import torch.distributed._functional_collectives as funcol


def should_stop(noticed, grad):
    dist.barrier()
    packed = torch.cat([grad.reshape(-1), torch.tensor([float(noticed)])])
    total = funcol.all_reduce(packed, "sum", dist.group.WORLD).wait()
    grad.copy_(total[:-1].view_as(grad))
    return bool(total[-1] > 0)
""",
    "the flags gathered as pickled objects (right value, wrong method)": """
def should_stop(noticed, grad):
    dist.all_reduce(grad)
    flags = [None] * world_size
    dist.all_gather_object(flags, noticed)
    return any(flags)
""",
}

STOP_OTHER_RIGHT = {
    "the flag packed first, summed by a functional all-reduce": """
import torch.distributed._functional_collectives as funcol


def should_stop(noticed, grad):
    packed = torch.cat([torch.tensor([float(noticed)]), grad.reshape(-1)])
    total = funcol.all_reduce(packed, "sum", dist.group.WORLD).wait()
    grad.copy_(total[1:].view_as(grad))
    return total[0].item() > 0.5
""",
    "gradient and flag gathered into one tensor, summed on each rank": """
def should_stop(noticed, grad):
    packed = torch.cat([grad.reshape(-1), torch.tensor([float(noticed)])])
    every = torch.zeros(world_size * packed.numel())
    dist.all_gather_into_tensor(every, packed)
    every = every.view(world_size, -1)
    total = every.sum(0)
    grad.copy_(total[:-1].view_as(grad))
    return bool(every[:, -1].any())
""",
}


@pytest.mark.parametrize("wrong", list(STOP_WRONG))
def test_13_stop_refuses_wrong_values_and_wrong_methods(ip, lesson_ranks, wrong):
    assert_checker(ip, LESSON, 2, STOP_WRONG[wrong], WORLD)


@pytest.mark.parametrize("right", list(STOP_OTHER_RIGHT))
def test_13_stop_accepts_other_right_answers(ip, lesson_ranks, right):
    assert_accepted(ip, 2, STOP_OTHER_RIGHT[right])


def test_13_run_all_checks_the_learners_answers(ip, lesson_ranks):
    wrong = {
        1: DRIFT_WRONG["parameters only (blind to the buffers)"],
        2: STOP_WRONG["the gradient only, each rank its own notice (the ranks disagree)"],
    }
    assert_run_all(ip, LESSON, wrong, WORLD)
