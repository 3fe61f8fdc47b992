"""Lesson 18's checkers fail the obvious wrong answers and pass the reference solutions.

As in tests/test_checkers.py: on a real gloo cluster of 2 ranks, the lesson's own checker cell runs after a
wrong solution (every rank must print ``not yet``) and after the lesson's reference solution (every rank
``pass``). Exercise 1's checker runs the learner's collectives (counts only) on every rank; exercise 2's
tests a pure function of the experts chosen. Neither needs the lesson's set-up.
"""

from __future__ import annotations

import pytest

from tests.checker_harness import assert_checker, assert_run_all, check

LESSON = "18_expert_parallel"
WORLD = 2

# exercise 1: capacity applied by the receiving expert, over every rank's rows in rank order

POSITION = """
def position_among_mine(expert_ids):
    order = expert_ids.argsort(stable=True)
    sorted_ids = expert_ids[order]
    position = torch.empty_like(expert_ids)
    position[order] = torch.arange(len(order)) - torch.searchsorted(sorted_ids, sorted_ids)
    return position
"""
RECEIVER_WRONG = {
    "each sender's own rows only (section 6's rule, no collective)": POSITION + """
def kept_by_expert(expert_ids, experts, capacity):
    return position_among_mine(expert_ids) < capacity
""",
    "the later ranks' rows taken first": POSITION + """
def kept_by_expert(expert_ids, experts, capacity):
    mine = torch.bincount(expert_ids, minlength=experts)
    counts = torch.empty(world_size * experts, dtype=mine.dtype)
    dist.all_gather_into_tensor(counts, mine)
    later = counts.view(world_size, experts)[rank + 1:].sum(dim=0)
    return later[expert_ids] + position_among_mine(expert_ids) < capacity
""",
    "every rank's expert ids gathered, padded, by a from-imported all_gather_into_tensor": """
def kept_by_expert(expert_ids, experts, capacity):
    from torch.distributed import all_gather_into_tensor
    padded = torch.full((16,), -1, dtype=torch.long)
    padded[:len(expert_ids)] = expert_ids
    table = torch.empty(world_size * 16, dtype=torch.long)
    all_gather_into_tensor(table, padded)
    taken, keep = {}, []
    for source, e in enumerate(table.tolist()):
        if e < 0:
            continue
        taken[e] = taken.get(e, 0) + 1
        if source // 16 == rank:
            keep.append(taken[e] <= capacity)
    return torch.tensor(keep, dtype=torch.bool)
""",
    "the counts all-reduced (everyone's total, not the earlier ranks')": POSITION + """
def kept_by_expert(expert_ids, experts, capacity):
    total = torch.bincount(expert_ids, minlength=experts)
    mine = total.clone()
    dist.all_reduce(total)
    return (total - mine)[expert_ids] + position_among_mine(expert_ids) < capacity
""",
}


@pytest.mark.parametrize("wrong", list(RECEIVER_WRONG))
def test_18_kept_by_expert_takes_rows_in_rank_order(ip, cluster, wrong):
    assert_checker(ip, LESSON, 1, RECEIVER_WRONG[wrong], WORLD)


def test_18_kept_by_expert_decided_by_the_receiver_passes(ip, cluster):
    """Another right method, with the lesson's differentiable functional all-to-all (an op that patching
    torch.distributed never sees): the counts go to the experts' ranks, each rank decides for its experts how
    many rows each sender may send, and the decisions come back: two all-to-alls of `experts` numbers."""
    by_receiver = POSITION + """
def kept_by_expert(expert_ids, experts, capacity):
    from torch.distributed._functional_collectives import all_to_all_single_autograd
    per_rank = experts // world_size
    mine = torch.bincount(expert_ids, minlength=experts)            # laid out by destination rank
    arrived = all_to_all_single_autograd(mine, [per_rank] * world_size, [per_rank] * world_size,
                                         dist.group.WORLD).view(world_size, per_rank)   # row s: rank s
    before = arrived.cumsum(dim=0) - arrived
    allowed = (capacity - before).clamp(min=0).minimum(arrived)    # how many rows each sender may send
    granted = all_to_all_single_autograd(allowed.flatten().contiguous(), [per_rank] * world_size,
                                         [per_rank] * world_size, dist.group.WORLD)
    return position_among_mine(expert_ids) < granted[expert_ids]
"""
    assert set(check(ip, LESSON, 1, by_receiver, WORLD).values()) == {"pass"}


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
        1: RECEIVER_WRONG["each sender's own rows only (section 6's rule, no collective)"],
        2: PRIORITY_WRONG["token order (the lesson's), not first choices first"],
    }
    assert_run_all(ip, LESSON, wrong, WORLD)
