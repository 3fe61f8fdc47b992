"""Lesson 00's exercise checkers refuse wrong answers and wrong methods and accept other right answers
(tests/checker_harness.py says how)."""

from __future__ import annotations

import pytest

from tests.checker_harness import assert_checker, assert_run_all, check

# lesson 00: one all_reduce, nothing else

WRONG = {
    (1, "no communication"): """
def everyones(value):
    return torch.full((world_size,), value, dtype=torch.float64)  # its own value everywhere
""",
    (1, "all_gather, not all_reduce"): """
def everyones(value):
    values = [torch.zeros(1, dtype=torch.float64) for _ in range(world_size)]
    dist.all_gather(values, torch.tensor([value], dtype=torch.float64))
    return torch.cat(values)
""",
    (1, "one all_reduce per rank"): """
def everyones(value):
    out = torch.zeros(world_size, dtype=torch.float64)
    for r in range(world_size):
        slot = torch.tensor([value if r == rank else 0.0], dtype=torch.float64)
        dist.all_reduce(slot)
        out[r] = slot
    return out
""",
    (1, "two slots, right only on 2 ranks"): """
def everyones(value):
    slots = torch.zeros(2, dtype=torch.float64)
    slots[rank] = value
    dist.all_reduce(slots)
    return slots
""",
    (2, "counts to 2, right only on 2 ranks"): """
def all_agree(flag):
    yes = torch.tensor([1 if flag else 0])
    dist.all_reduce(yes)
    return yes.item() == 2
""",
    (2, "any rank's flag, not every rank's"): """
def all_agree(flag):
    yes = torch.tensor([1 if flag else 0])
    dist.all_reduce(yes, op=dist.ReduceOp.MAX)
    return bool(yes.item())
""",
    (2, "its own flag only"): """
def all_agree(flag):
    return flag
""",
    (2, "all_gather_object, not all_reduce"): """
def all_agree(flag):
    flags = [None] * world_size
    dist.all_gather_object(flags, flag)
    return all(flags)
""",
}

RIGHT = {
    (1, "one-hot rows"): """
def everyones(value):
    one_hot = torch.eye(world_size, dtype=torch.float64)[rank] * value
    dist.all_reduce(one_hot)
    return one_hot
""",
    (2, "MIN of the flags"): """
def all_agree(flag):
    lowest = torch.tensor([int(flag)])
    dist.all_reduce(lowest, op=dist.ReduceOp.MIN)  # any False makes the minimum 0
    return bool(lowest.item())
""",
    (2, "a one-element bool tensor"): """
def all_agree(flag):
    lowest = torch.tensor([int(flag)])
    dist.all_reduce(lowest, op=dist.ReduceOp.MIN)
    return lowest.bool()  # a tensor holding one bool
""",
    (2, "a NumPy bool"): """
import numpy


def all_agree(flag):
    yes = torch.tensor([float(flag)])
    dist.all_reduce(yes, op=dist.ReduceOp.PRODUCT)
    return numpy.bool_(yes.item() == 1.0)
""",
}


@pytest.mark.parametrize("wrong", list(WRONG), ids=[name for _, name in WRONG])
def test_00_checkers_refuse_wrong_methods(ip, cluster, wrong):
    assert_checker(ip, "00_start_here", wrong[0], WRONG[wrong], 2)


def test_00_checkers_accept_other_right_answers(ip, cluster):
    for (exercise, _), right in RIGHT.items():
        assert set(check(ip, "00_start_here", exercise, right, 2).values()) == {"pass"}


def test_00_run_all_checks_the_learners_answers(ip, cluster):
    wrong = {1: WRONG[1, "no communication"], 2: WRONG[2, "its own flag only"]}
    assert_run_all(ip, "00_start_here", wrong, 2)
