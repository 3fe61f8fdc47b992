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


# exercise 2: compare shapes and dtypes with a few numbers, then reduce; raise on every rank if they differ

CHECKED_WRONG = {
    "no check at all": """
def checked_all_reduce(t):
    dist.all_reduce(t)
""",
    "a local check only": """
def checked_all_reduce(t):
    if t.dim() != 2:
        raise RuntimeError(f"rank {rank}: {list(t.shape)} {t.dtype}")
    dist.all_reduce(t)
""",
    "the sizes compared, not the dtypes": """
def checked_all_reduce(t):
    numel = torch.tensor([t.numel()], device=t.device)
    largest = numel.clone()
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    if largest.item() != numel.item():
        raise RuntimeError(f"rank {rank}: {list(t.shape)} {t.dtype}, largest {largest.item()}")
    dist.all_reduce(t)
""",
    "the whole tensor gathered to compare": """
def checked_all_reduce(t):
    flat = t.reshape(-1)[:64].float()
    everyone = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(everyone, flat)
    described = [None] * world_size
    dist.all_gather_object(described, (list(t.shape), str(t.dtype)))
    if len(set(map(str, described))) > 1:
        raise RuntimeError("; ".join(f"rank {r}: {s} {d}" for r, (s, d) in enumerate(described)))
    dist.all_reduce(t)
""",
}

CHECKED_RIGHT_OTHERWISE = """
CODES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32]


def checked_all_reduce(t):
    mine = torch.full((10,), -1, dtype=torch.int64, device=t.device)
    mine[0], mine[1] = CODES.index(t.dtype), t.dim()
    mine[2 : 2 + t.dim()] = torch.tensor(t.shape)
    everyone = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(everyone, mine)
    if any(not torch.equal(other, mine) for other in everyone):
        raise RuntimeError("; ".join(f"rank {r}: {f[2 : 2 + int(f[1])].tolist()} {CODES[int(f[0])]}"
                                     for r, f in enumerate(everyone)))
    dist.all_reduce(t)
"""


@pytest.mark.parametrize("wrong", list(CHECKED_WRONG))
def test_12_checked_all_reduce_refuses(ip, lesson_ranks, wrong):
    assert_checker(ip, LESSON, 2, CHECKED_WRONG[wrong], 2)
    assert "[ranks 0,1]\nok" in on_ranks(ip, "dist.barrier(); print('ok')")  # the group still works


def test_12_checked_all_reduce_accepts_a_tensor_fingerprint(ip, lesson_ranks):
    from tests.checker_harness import check

    assert set(check(ip, LESSON, 2, CHECKED_RIGHT_OTHERWISE, 2).values()) == {"pass"}


def test_12_run_all_checks_the_learners_answers(ip, lesson_ranks):
    full_buffers = UNJOINED_WRONG["entries that left a full buffer counted as never recorded"]
    wrong = {1: full_buffers, 2: CHECKED_WRONG["a local check only"]}
    assert_run_all(ip, LESSON, wrong, 2)
