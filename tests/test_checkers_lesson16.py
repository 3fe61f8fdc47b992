"""Lesson 16's checkers fail wrong answers and wrong methods, and pass the reference and other right answers.

As in tests/test_checkers.py: on a real gloo cluster, the lesson's own checker cell runs after a wrong
solution (every rank must print "not yet") and after the lesson's reference solution (every rank "pass"). Both
exercises are arithmetic (a pipeline's timeline, a cut of a model into stages): the checkers need nothing from
the lesson's earlier cells and try several numbers of stages themselves, so two ranks are enough.
"""

from __future__ import annotations

import pytest

from tests.checker_harness import assert_checker, assert_run_all, check

LESSON = "16_pipeline_parallel"
WORLD = 2


def assert_accepted(ip, exercise: int, answer: str) -> None:
    assert set(check(ip, LESSON, exercise, answer, WORLD).values()) == {"pass"}


# exercise 1: when a step ends, for any order of forwards and backwards and any stage times

SPAN_WRONG = {
    "the formula (m + p - 1)(f + b) with the mean stage times": """
def pipeline_span(orders, forward, backward):
    p, m = len(orders), len(orders[0].split()) // 2
    return (m + p - 1) * (sum(forward) + sum(backward)) / p
""",
    "the formula with the slowest stage's times": """
def pipeline_span(orders, forward, backward):
    p, m = len(orders), len(orders[0].split()) // 2
    return (m + p - 1) * max(f + b for f, b in zip(forward, backward))
""",
    "each stage's own work, dependencies ignored": """
def pipeline_span(orders, forward, backward):
    m = len(orders[0].split()) // 2
    return max(m * (f + b) for f, b in zip(forward, backward))
""",
    "the order ignored (every stage as GPipe)": """
def pipeline_span(orders, forward, backward):
    p, m = len(orders), len(orders[0].split()) // 2
    end_f = [[0] * m for _ in range(p)]
    for s in range(p):
        t = 0
        for i in range(m):
            t = max(t, end_f[s - 1][i] if s else 0) + forward[s]
            end_f[s][i] = t
    end_b = [[0] * m for _ in range(p)]
    for s in reversed(range(p)):
        t = end_f[s][m - 1]
        for i in range(m):
            t = max(t, end_b[s + 1][i] if s < p - 1 else end_f[s][i]) + backward[s]
            end_b[s][i] = t
    return max(end_b[s][m - 1] for s in range(p))
""",
}


@pytest.mark.parametrize("wrong", list(SPAN_WRONG))
def test_16_pipeline_span_must_follow_the_dependencies(ip, cluster, wrong):
    assert_checker(ip, LESSON, 1, SPAN_WRONG[wrong], WORLD)


def test_16_pipeline_span_by_recursion_passes(ip, cluster):
    """Another right method: each action's end from its two predecessors, memoised, not a sweep."""
    recursive = """
from functools import lru_cache


def pipeline_span(orders, forward, backward):
    p = len(orders)
    words = [o.split() for o in orders]
    where = {(w, s): j for s in range(p) for j, w in enumerate(words[s])}

    @lru_cache(maxsize=None)
    def end(s, j):
        word = words[s][j]
        kind, i = word[0], int(word[1:])
        ready = end(s, j - 1) if j else 0.0
        if kind == "F" and s > 0:
            ready = max(ready, end(s - 1, where[word, s - 1]))
        if kind == "B":
            other = (word, s + 1) if s < p - 1 else (f"F{i}", s)
            ready = max(ready, end(other[1], where[other]))
        return ready + (forward[s] if kind == "F" else backward[s])

    return max(end(s, len(words[s]) - 1) for s in range(p))
"""
    assert_accepted(ip, 1, recursive)


# exercise 2: a cut of the layers into p stages whose slowest stage is as fast as possible

CUT_WRONG = {
    "equal numbers of layers": """
def split_stages(costs, p):
    return [len(costs) * s // p for s in range(p + 1)]
""",
    "greedy: a new stage once the average is passed": """
def split_stages(costs, p):
    target, cut, total = sum(costs) / p, [0], 0
    for i, c in enumerate(costs):
        total += c
        if total >= target and len(cut) < p and i + 1 < len(costs):
            cut.append(i + 1)
            total = 0
    while len(cut) < p:
        cut.append(len(costs) - (p - len(cut)))
    return cut + [len(costs)]
""",
    "the stages' sizes, not the cut": """
def split_stages(costs, p):
    return [len(costs) // p] * p
""",
}


@pytest.mark.parametrize("wrong", list(CUT_WRONG))
def test_16_split_stages_must_balance_the_slowest_stage(ip, cluster, wrong):
    assert_checker(ip, LESSON, 2, CUT_WRONG[wrong], WORLD)


def test_16_split_stages_by_exhaustive_search_passes(ip, cluster):
    """Another right method, and other cuts where several are as good: try every cut, keep the last best."""
    exhaustive = """
import itertools


def split_stages(costs, p):
    best = None
    for inner in itertools.combinations(range(1, len(costs)), p - 1):
        cut = [0, *inner, len(costs)]
        slowest = max(sum(costs[a:b]) for a, b in zip(cut, cut[1:]))
        if best is None or slowest <= best[0]:
            best = (slowest, cut)
    return best[1]
"""
    assert_accepted(ip, 2, exhaustive)


def test_16_run_all_checks_the_learners_answers(ip, cluster):
    wrong = {
        1: SPAN_WRONG["each stage's own work, dependencies ignored"],
        2: CUT_WRONG["equal numbers of layers"],
    }
    assert_run_all(ip, LESSON, wrong, WORLD)
