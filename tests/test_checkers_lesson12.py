"""Lesson 12's checkers fail the obvious wrong answers and pass the reference solutions.

As in tests/test_checkers.py: on a real 2-rank gloo cluster, the lesson's own checker cell runs after a wrong
solution (every rank must print ``fail``) and after the lesson's reference solution (every rank ``pass``).
"""

from __future__ import annotations

import pytest
from IPython.utils.capture import capture_output

from tests.checker_harness import assert_checker, assert_run_all, on_ranks
from tests.conftest import running_cluster

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


# exercise 2: a broadcast that names its tensor; equal names cost a few numbers, different ones raise

TAGGED_WRONG = {
    "no check at all": """
def tagged_broadcast(t, name, src):
    dist.broadcast(t, src)
""",
    "the names gathered from every rank on every call": """
def tagged_broadcast(t, name, src):
    names = [None] * world_size
    dist.all_gather_object(names, name)
    if len(set(names)) > 1:
        raise RuntimeError("; ".join(f"rank {r}: {n}" for r, n in enumerate(names)))
    dist.broadcast(t, src)
""",
    "src's name and tensor sent as a pickled object to compare": """
def tagged_broadcast(t, name, src):
    theirs = [name, t.tolist()]
    dist.broadcast_object_list(theirs, src=src)
    differs = torch.tensor([float(theirs[0] != name)], device=t.device)
    dist.all_reduce(differs, op=dist.ReduceOp.MAX)
    if differs.item():
        names = [None] * world_size
        dist.all_gather_object(names, name)
        raise RuntimeError("; ".join(f"rank {r}: {n}" for r, n in enumerate(names)))
    t.copy_(torch.tensor(theirs[1], device=t.device))
""",
    "the ranks compared, then t broadcast anyway": """
import zlib
def tagged_broadcast(t, name, src):
    tag = torch.tensor([zlib.crc32(name.encode())], dtype=torch.int64, device=t.device)
    low, high = tag.clone(), tag.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.broadcast(t, src)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    if low.item() != high.item():
        names = [None] * world_size
        dist.all_gather_object(names, name)
        raise RuntimeError("; ".join(f"rank {r}: {n}" for r, n in enumerate(names)))
""",
}

# right on 2 ranks: the message names ranks 0 and 1 only
TAGGED_TWO_RANKS = """
import zlib
def tagged_broadcast(t, name, src):
    tag = zlib.crc32(name.encode())
    low_high = torch.tensor([tag, -tag], dtype=torch.int64, device=t.device)
    dist.all_reduce(low_high, op=dist.ReduceOp.MIN)
    if low_high[0].item() != -low_high[1].item():
        names = [None] * world_size
        dist.all_gather_object(names, name)
        raise RuntimeError("; ".join(f"rank {r}: {names[r]}" for r in range(2)))
    dist.broadcast(t, src)
"""

# another right answer: src's tag broadcast, each rank compares, one flag all-reduced
TAGGED_RIGHT_OTHERWISE = """
import zlib
def tagged_broadcast(t, name, src):
    mine = zlib.crc32(name.encode())
    theirs = torch.tensor([mine], dtype=torch.int64, device=t.device)
    dist.broadcast(theirs, src)
    differs = torch.tensor([int(theirs.item() != mine)], device=t.device)
    dist.all_reduce(differs, op=dist.ReduceOp.MAX)
    if differs.item():
        names = [None] * world_size
        dist.all_gather_object(names, name)
        raise RuntimeError(", ".join(f"rank {r}: {n}" for r, n in enumerate(names)))
    dist.broadcast(t, src)
"""


def test_12_tagged_broadcast_on_four_ranks(ip):
    """On 4 ranks a message built for 2 is refused; the reference and another right answer pass. First in the
    module: no other cluster runs yet (the module's 2-rank one starts with the next test)."""
    from tests.checker_harness import check

    with running_cluster(ip, 4):
        assert_checker(ip, LESSON, 2, TAGGED_TWO_RANKS, 4)
        assert set(check(ip, LESSON, 2, TAGGED_RIGHT_OTHERWISE, 4).values()) == {"pass"}


# exercise 1: the first collective some ranks never recorded, per group, with buffers that dropped old entries

UNJOINED_RIGHT_BUT = """
def first_unjoined(traces, group):
    seen = {r: {e["collective_seq_id"]: e["profiling_name"] for e in entries if FILTER}
            for r, entries in traces.items()}
    operations = {seq: name for mine in seen.values() for seq, name in mine.items()}
    for seq in sorted(operations):
        missing = sorted(r for r, mine in seen.items() if MISSING)
        if missing:
            return seq, operations[seq], missing
    return None
"""
ONE_GROUP = 'e["process_group"][0] == group'
UNJOINED_WRONG = {
    "entries of every group counted together": UNJOINED_RIGHT_BUT.replace(" if FILTER", "").replace(
        "MISSING", "seq not in mine and (not mine or seq > min(mine))"
    ),
    "entries that left a full buffer counted as never recorded": UNJOINED_RIGHT_BUT.replace(
        "FILTER", ONE_GROUP
    ).replace("MISSING", "seq not in mine"),
    "the ranks that did record it": UNJOINED_RIGHT_BUT.replace("FILTER", ONE_GROUP).replace(
        "MISSING", "seq in mine"
    ),
}


@pytest.mark.parametrize("wrong", list(UNJOINED_WRONG))
def test_12_first_unjoined_must_follow_groups_and_full_buffers(ip, lesson_ranks, wrong):
    assert_checker(ip, LESSON, 1, UNJOINED_WRONG[wrong], 2)


# exercise 1: a different right answer (a rank's entries of the group, walked in order)

UNJOINED_RIGHT_OTHERWISE = """
def first_unjoined(traces, group):
    mine = {r: sorted((e["collective_seq_id"], e["profiling_name"]) for e in entries
                      if e["process_group"][0] == group) for r, entries in traces.items()}
    every = sorted({pair for pairs in mine.values() for pair in pairs})
    for seq, name in every:
        missing = [r for r in sorted(mine) if (not mine[r] or seq > mine[r][0][0])
                   and seq not in [s for s, _ in mine[r]]]
        if missing:
            return (seq, name, missing)
    return None
"""


def test_12_first_unjoined_accepts_another_walk(ip, lesson_ranks):
    from tests.checker_harness import check

    assert set(check(ip, LESSON, 1, UNJOINED_RIGHT_OTHERWISE, 2).values()) == {"pass"}


@pytest.mark.parametrize("wrong", list(TAGGED_WRONG))
def test_12_tagged_broadcast_refuses(ip, lesson_ranks, wrong):
    assert_checker(ip, LESSON, 2, TAGGED_WRONG[wrong], 2)
    assert "[ranks 0,1]\nok" in on_ranks(ip, "dist.barrier(); print('ok')")  # the group still works


def test_12_tagged_broadcast_accepts_a_broadcast_tag(ip, lesson_ranks):
    from tests.checker_harness import check

    assert set(check(ip, LESSON, 2, TAGGED_RIGHT_OTHERWISE, 2).values()) == {"pass"}
    assert set(check(ip, LESSON, 2, TAGGED_TWO_RANKS, 2).values()) == {"pass"}  # right on 2 ranks


def test_12_run_all_checks_the_learners_answers(ip, lesson_ranks):
    full_buffers = UNJOINED_WRONG["entries that left a full buffer counted as never recorded"]
    wrong = {1: full_buffers, 2: TAGGED_WRONG["no check at all"]}
    assert_run_all(ip, LESSON, wrong, 2)
