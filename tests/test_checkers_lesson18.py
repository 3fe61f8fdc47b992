"""Lesson 18's checkers fail the obvious wrong answers and pass the reference solutions.

As in tests/test_checkers.py: on a real gloo cluster of 2 ranks, the lesson's own checker cell runs after a
wrong solution (every rank must print ``not yet``) and after the lesson's reference solution (every rank
``pass``). Exercise 1's checker runs a collective (the learner's count exchange) on every rank; exercise 2's
tests a pure function of the experts chosen. Neither needs the lesson's set-up.
"""

from __future__ import annotations

import pytest

from tests.checker_harness import assert_checker, assert_run_all, check

LESSON = "18_expert_parallel"
WORLD = 2

# exercise 1: the count exchange for experts dealt round-robin (expert e on rank e % world_size)

EXCHANGE_WRONG = {
    "experts in contiguous blocks (the lesson's layout), not round-robin": """
def exchange_counts(expert_ids):
    destination = expert_ids // 4
    send = torch.bincount(destination, minlength=world_size)
    recv = torch.zeros_like(send)
    dist.all_to_all_single(recv, send)
    return destination.argsort(stable=True), send.tolist(), recv.tolist()
""",
    "no exchange: recv_sizes taken to be send_sizes": """
def exchange_counts(expert_ids):
    destination = expert_ids % world_size
    send = torch.bincount(destination, minlength=world_size).tolist()
    return destination.argsort(stable=True), send, send
""",
    "rows sorted by expert, not by destination rank": """
def exchange_counts(expert_ids):
    destination = expert_ids % world_size
    send = torch.bincount(destination, minlength=world_size)
    recv = torch.zeros_like(send)
    dist.all_to_all_single(recv, send)
    return expert_ids.argsort(stable=True), send.tolist(), recv.tolist()
""",
    "sizes as tensors, not lists": """
def exchange_counts(expert_ids):
    destination = expert_ids % world_size
    send = torch.bincount(destination, minlength=world_size)
    recv = torch.zeros_like(send)
    dist.all_to_all_single(recv, send)
    return destination.argsort(stable=True), send, recv
""",
    "counts gathered from everyone instead of swapped (all ranks' rows to me summed)": """
def exchange_counts(expert_ids):
    destination = expert_ids % world_size
    send = torch.bincount(destination, minlength=world_size)
    total = send.clone()
    dist.all_reduce(total)
    return destination.argsort(stable=True), send.tolist(), total.tolist()
""",
    "every rank's expert ids gathered (right sizes, the rows' ids all travel)": """
def exchange_counts(expert_ids):
    destination = expert_ids % world_size
    everyone = [None] * world_size
    dist.all_gather_object(everyone, expert_ids.tolist())
    send = torch.bincount(destination, minlength=world_size).tolist()
    recv = [sum(1 for e in ids if e % world_size == rank) for ids in everyone]
    return destination.argsort(stable=True), send, recv
""",
    "one all-to-all per destination rank (right sizes)": """
def exchange_counts(expert_ids):
    destination = expert_ids % world_size
    send = torch.bincount(destination, minlength=world_size)
    recv = torch.zeros_like(send)
    for d in range(world_size):
        one = torch.zeros_like(send)
        one[d] = send[d]
        got = torch.zeros_like(send)
        dist.all_to_all_single(got, one)
        recv += got
    return destination.argsort(stable=True), send.tolist(), recv.tolist()
""",
}


@pytest.mark.parametrize("wrong", list(EXCHANGE_WRONG))
def test_18_exchange_counts_must_swap_round_robin_counts(ip, cluster, wrong):
    assert_checker(ip, LESSON, 1, EXCHANGE_WRONG[wrong], WORLD)


# exercise 2: GShard's order, every token's first choice before any second choice

PRIORITY_WRONG = {
    "token order (the lesson's), not first choices first": """
def keep_first_choices_first(chosen, capacity):
    flat = chosen.flatten()
    kept = torch.zeros_like(flat, dtype=torch.bool)
    for e in flat.unique():
        rows = (flat == e).nonzero().flatten()
        kept[rows[:capacity]] = True
    return kept.view(chosen.shape)
""",
    "the last rows of each expert kept": """
def keep_first_choices_first(chosen, capacity):
    flat = chosen.t().flatten()
    kept = torch.zeros_like(flat, dtype=torch.bool)
    for e in flat.unique():
        rows = (flat == e).nonzero().flatten()
        if capacity:
            kept[rows[-capacity:]] = True
    return kept.view(chosen.shape[1], chosen.shape[0]).t()
""",
    "off by one (capacity + 1 kept)": """
def keep_first_choices_first(chosen, capacity):
    flat = chosen.t().flatten()
    kept = torch.zeros_like(flat, dtype=torch.bool)
    for e in flat.unique():
        rows = (flat == e).nonzero().flatten()
        kept[rows[:capacity + 1]] = True
    return kept.view(chosen.shape[1], chosen.shape[0]).t()
""",
    "nothing dropped": """
def keep_first_choices_first(chosen, capacity):
    return torch.ones_like(chosen, dtype=torch.bool)
""",
    "the slot-major mask not turned back to (tokens, slots)": """
def keep_first_choices_first(chosen, capacity):
    flat = chosen.t().flatten()
    kept = torch.zeros_like(flat, dtype=torch.bool)
    for e in flat.unique():
        rows = (flat == e).nonzero().flatten()
        kept[rows[:capacity]] = True
    return kept.view(chosen.shape)
""",
}


@pytest.mark.parametrize("wrong", list(PRIORITY_WRONG))
def test_18_capacity_must_take_first_choices_first(ip, cluster, wrong):
    assert_checker(ip, LESSON, 2, PRIORITY_WRONG[wrong], WORLD)


def test_18_exchange_counts_by_all_gather_of_counts_passes(ip, cluster):
    """Another right method: one all-gather of each rank's counts (world_size numbers from each), each rank
    reading its column."""
    gathered = """
def exchange_counts(expert_ids):
    destination = expert_ids % world_size
    send = torch.bincount(destination, minlength=world_size)
    table = torch.empty(world_size * world_size, dtype=send.dtype, device=send.device)
    dist.all_gather_into_tensor(table, send)
    recv = table.reshape(world_size, world_size)[:, rank]
    return torch.sort(destination, stable=True).indices, send.tolist(), recv.tolist()
"""
    assert set(check(ip, LESSON, 1, gathered, WORLD).values()) == {"pass"}


def test_18_capacity_by_cumulative_counts_passes(ip, cluster):
    """Another right method, without a loop over experts: each row's position among its expert's rows, slot by
    slot, from a cumulative one-hot count."""
    cumulative = """
import torch.nn.functional as F


def keep_first_choices_first(chosen, capacity):
    slot_major = chosen.t().flatten()
    one_hot = F.one_hot(slot_major.long(), int(chosen.max()) + 1 if chosen.numel() else 1)
    position = (one_hot.cumsum(dim=0) * one_hot).sum(dim=1) - 1
    return (position < capacity).view(chosen.shape[1], chosen.shape[0]).t()
"""
    assert set(check(ip, LESSON, 2, cumulative, WORLD).values()) == {"pass"}


def test_18_run_all_checks_the_learners_answers(ip, cluster):
    wrong = {
        1: EXCHANGE_WRONG["no exchange: recv_sizes taken to be send_sizes"],
        2: PRIORITY_WRONG["token order (the lesson's), not first choices first"],
    }
    assert_run_all(ip, LESSON, wrong, WORLD)
