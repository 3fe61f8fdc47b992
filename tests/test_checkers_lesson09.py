"""Lesson 09's exercise checkers refuse wrong answers and pass the reference solutions
(tests/checker_harness.py says how). Both exercises run in the notebook's own process, next to section 6's
``gpipe_order``: no cluster."""

from __future__ import annotations

import pytest
from IPython.utils.capture import capture_output

from tests.checker_harness import assert_run_all, lesson_cell, reference_answer

# lesson 09: where to cut a model into two stages; the micro-batches' activations a stage holds at peak

LESSON = "09_ddp_model_parallel"

CUT_WRONG = {
    "half the layers": """
def best_cut(costs, m):
    return len(costs) // 2
""",
    "the first cut that reaches half the cost": """
def best_cut(costs, m):
    total, running = sum(costs), 0
    for k, cost in enumerate(costs, start=1):
        running += cost
        if running >= total / 2:
            return min(k, len(costs) - 1)
""",
    "the fastest first stage": """
def best_cut(costs, m):
    return 1
""",
}
CUT_RIGHT_OTHER = """
def best_cut(costs, m):
    # simulate every cut with per-stage times and keep the shortest step
    def step(k):
        forward = [sum(costs[:k]) / m, sum(costs[k:]) / m]
        end, free = {}, [0.0, 0.0]
        for kind, s, i in gpipe_order(2, m):
            if kind == "F":
                ready = end.get(("F", s - 1, i), 0.0)
            else:
                ready = end[("B", 1, i)] if s == 0 else end[("F", 1, i)]
            end[kind, s, i] = free[s] = max(free[s], ready) + forward[s] * (1 if kind == "F" else 2)
        return max(free)
    return min(range(1, len(costs)), key=step)
"""

HELD_WRONG = {
    "GPipe's answer for every order": """
def held_at_peak(order, stages):
    m = len({i for _, _, i in order})
    return [m] * stages
""",
    "all stages counted together": """
def held_at_peak(order, stages):
    held = peak = 0
    for kind, _, _ in order:
        held += 1 if kind == "F" else -1
        peak = max(peak, held)
    return [peak] * stages
""",
    "forwards counted, backwards never released": """
def held_at_peak(order, stages):
    return [sum(1 for kind, s, _ in order if kind == "F" and s == stage) for stage in range(stages)]
""",
}
HELD_RIGHT_OTHER = """
def held_at_peak(order, stages):
    peak = []
    for stage in range(stages):
        mine = [kind for kind, s, _ in order if s == stage]
        running = [mine[: j + 1].count("F") - mine[: j + 1].count("B") for j in range(len(mine))]
        peak.append(max(running, default=0))
    return peak
"""


def run(ip, code: str) -> str:
    with capture_output() as captured:
        result = ip.run_cell(code)
    assert result.error_in_exec is None and result.error_before_exec is None, captured.stdout
    return captured.stdout


@pytest.fixture
def gpipe(ip):
    """Section 6's gpipe_order in the notebook's namespace (its cell without the prints: they need a run)."""
    source = lesson_cell(LESSON, "def gpipe_order(")
    run(ip, source[: source.index("\nprint(")])
    yield ip
    ip.user_ns.pop("gpipe_order", None)


def verdict_of(ip, exercise: int, answer: str) -> str:
    text = run(ip, answer + "\n" + lesson_cell(LESSON, f"# Checker for exercise {exercise}"))
    [line] = [line for line in text.splitlines() if line.startswith(f"exercise {exercise}: ")]
    return "pass" if line == f"exercise {exercise}: pass" else "fail"


@pytest.mark.parametrize(
    ("exercise", "wrong"),
    [(1, name) for name in CUT_WRONG] + [(2, name) for name in HELD_WRONG],
)
def test_09_checkers_refuse_wrong_methods(gpipe, exercise, wrong):
    answer = (CUT_WRONG if exercise == 1 else HELD_WRONG)[wrong]
    assert verdict_of(gpipe, exercise, answer) == "fail"


@pytest.mark.parametrize("exercise", [1, 2])
def test_09_checkers_pass_the_reference_and_another_right_answer(gpipe, exercise):
    assert verdict_of(gpipe, exercise, reference_answer(LESSON, exercise)) == "pass"
    other = CUT_RIGHT_OTHER if exercise == 1 else HELD_RIGHT_OTHER
    assert verdict_of(gpipe, exercise, other) == "pass"


def test_09_run_all_checks_the_learners_answers(gpipe):
    wrong = {1: CUT_WRONG["half the layers"], 2: HELD_WRONG["GPipe's answer for every order"]}
    assert_run_all(gpipe, LESSON, wrong, 1)
