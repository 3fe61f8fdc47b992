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
    full_buffers = UNJOINED_WRONG["entries that left a full buffer counted as never recorded"]
    wrong = {1: full_buffers, 2: DUMP_WRONG["nothing armed"]}
    assert_run_all(ip, LESSON, wrong, 2)
