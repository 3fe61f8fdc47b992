"""Lesson 12's checkers fail the obvious wrong answers and pass the reference solutions.

As in tests/test_checkers.py: on a real 2-rank gloo cluster, the lesson's own checker cell runs after a wrong
solution (every rank must print ``fail``) and after the lesson's reference solution (every rank ``pass``).
"""

from __future__ import annotations

import pytest
from IPython.utils.capture import capture_output

from tests.conftest import running_cluster
from tests.test_checkers import assert_checker, assert_run_all, lesson_cell, on_ranks

LESSON = "12_debugging"


@pytest.fixture(scope="module")
def lesson_ranks(ip, tmp_path_factory):
    """A 2-rank cluster with the lesson's ``work`` directory pushed to the ranks."""
    with running_cluster(ip, 2) as magics:
        ip.user_ns["work"] = str(tmp_path_factory.mktemp("lesson12"))
        with capture_output():
            ip.run_line_magic("dist_push", "work")
        del ip.user_ns["work"]
        yield magics


# exercise 1: the job must take the same steps on every rank, on the given group

TRAIN_WRONG = {
    "the broken job as given (rank 0 hangs in its third all_reduce)": lesson_cell(
        LESSON, "The job to diagnose"
    ).replace("def broken_train_job(", "def train_job("),
    "no communication at all (no hang, ranks drift apart)": """
from torch import nn


def train_job(group=None):
    torch.manual_seed(0)
    model = nn.Linear(3, 1).to(device)
    X = torch.randn(9, 3, generator=torch.Generator().manual_seed(1)).to(device)
    y = X.sum(1, keepdim=True)
    mine = range(rank, len(X), dist.get_world_size(group))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for start in range(0, len(mine), 2):
        batch = list(mine[start:start + 2])
        opt.zero_grad()
        nn.functional.mse_loss(model(X[batch]), y[batch]).backward()
        opt.step()
    return model
""",
    "rank 0 takes its last step alone (no hang, ranks drift apart)": """
from torch import nn


def train_job(group=None):
    torch.manual_seed(0)
    model = nn.Linear(3, 1).to(device)
    X = torch.randn(9, 3, generator=torch.Generator().manual_seed(1)).to(device)
    y = X.sum(1, keepdim=True)
    size = dist.get_world_size(group)
    mine = range(rank, len(X), size)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for start in range(0, len(mine), 2):
        batch = list(mine[start:start + 2])
        opt.zero_grad()
        nn.functional.mse_loss(model(X[batch]), y[batch]).backward()
        if start < 4:
            for p in model.parameters():
                dist.all_reduce(p.grad, group=group)
                p.grad /= size
        opt.step()
    return model
""",
    "summed gradients, not averaged (the fix that lets rank 1 join with zeros)": """
from torch import nn


def train_job(group=None):
    torch.manual_seed(0)
    model = nn.Linear(3, 1).to(device)
    X = torch.randn(9, 3, generator=torch.Generator().manual_seed(1)).to(device)
    y = X.sum(1, keepdim=True)
    mine = range(rank, len(X), dist.get_world_size(group))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for start in range(0, 6, 2):  # 3 steps on every rank
        batch = list(mine[start:start + 2])
        opt.zero_grad()
        if batch:
            nn.functional.mse_loss(model(X[batch]), y[batch]).backward()
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=group)  # summed, never divided
        opt.step()
    return model
""",
}


@pytest.mark.parametrize("wrong", list(TRAIN_WRONG))
def test_12_diagnosed_job_must_not_hang_and_must_agree(ip, lesson_ranks, wrong):
    assert_checker(ip, LESSON, 1, TRAIN_WRONG[wrong], 2)


# exercise 2: a dump on each signal, and none before

DUMP_WRONG = {
    "one dump right away, none on the signal": """
import faulthandler


def arm_stack_dumps(path):
    with open(path, "a") as f:
        faulthandler.dump_traceback(file=f)
""",
    "nothing armed": """
def arm_stack_dumps(path):
    open(path, "a").close()
""",
}


@pytest.mark.parametrize("wrong", list(DUMP_WRONG))
def test_12_stack_dumps_must_come_on_the_signal(ip, lesson_ranks, wrong):
    assert_checker(ip, LESSON, 2, DUMP_WRONG[wrong], 2)
    # the ranks still answer (no signal killed them) and the magic's own SIGUSR1 handler is intact
    assert "[ranks 0,1]\nok" in on_ranks(ip, "print('ok')")


def test_12_run_all_checks_the_learners_answers(ip, lesson_ranks):
    no_communication = TRAIN_WRONG["no communication at all (no hang, ranks drift apart)"]
    wrong = {1: no_communication, 2: DUMP_WRONG["nothing armed"]}
    assert_run_all(ip, LESSON, wrong, 2)
