"""The harness of the lessons' checker tests (tests/test_checkers_lessonNN.py): the checkers fail the
obvious wrong answers and pass the reference solutions, and they test the learner's own answer when the
notebook runs from top to bottom.

Every exercise has three cells, in this order: the learner's stub ("# Exercise N: your answer"), which
keeps the exercise's names; the checker ("# Checker for exercise N"), which tests those names; the
reference solution ("# Reference solution to exercise N"), whose names end in ``_reference`` so that it
never replaces the learner's answer. Two kinds of tests, on real gloo clusters:

- ``assert_checker``: a wrong answer, then the reference (its names given back), each followed by the
  checker.
- ``assert_run_all``: the lesson's exercise cells run in the notebook's order (stub, checker, reference,
  next stub, ...), with every stub replaced by a known-wrong answer, then by the reference's code: every
  checker must say "not yet" to the first and "pass" to the second. A reference that ran before its
  checker, or a cell that redefined the learner's names before the checker, fails it.

Cells are found by their text, so the tests follow edits to the lessons. Lesson 04 runs on 4 ranks, as in
the lesson; the others on the module's 2 ranks.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
from IPython.utils.capture import capture_output

from tests.conftest import run_cell, shown_text

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def lesson_cell(lesson: str, text: str) -> str:
    """The code of the one code cell of ``lesson`` containing ``text``, without a ``%%distributed`` line."""
    notebook = nbformat.read(NOTEBOOKS / f"{lesson}.ipynb", as_version=4)
    [source] = [cell.source for cell in notebook.cells if cell.cell_type == "code" and text in cell.source]
    first, _, rest = source.partition("\n")
    return rest if first.startswith("%%distributed") else source


def on_ranks(ip, code: str) -> str:
    """Run ``code`` on every rank; its shown text (the cell must not fail)."""
    captured, error = run_cell(ip, "", code)
    assert error is None, shown_text(captured)
    return shown_text(captured)


def verdicts(text: str, exercise: int) -> dict[int, str]:
    """``{rank: "pass" or "fail"}`` from the rank blocks (``[rank 1]``, ``[ranks 0,1]``, ``[ranks 0-3]``);
    a checker prints ``exercise N: pass`` or ``exercise N: not yet: ...`` (read as "fail")."""
    found: dict[int, str] = {}
    ranks: list[int] = []
    for line in text.splitlines():
        if header := re.fullmatch(r"\[ranks? ([\d,\-]+)\]", line):
            ranks = []
            for part in header[1].split(","):
                first, _, last = part.partition("-")
                ranks += range(int(first), int(last or first) + 1)
        elif verdict := re.fullmatch(rf"exercise {exercise}: (pass|not yet: .+)", line):
            found.update(dict.fromkeys(ranks, "pass" if verdict[1] == "pass" else "fail"))
    return found


def check(ip, lesson: str, exercise: int, solution: str, world_size: int) -> dict[int, str]:
    """Every rank's verdict of the lesson's checker after running ``solution`` on the ranks."""
    on_ranks(ip, solution)
    text = on_ranks(ip, lesson_cell(lesson, f"# Checker for exercise {exercise}"))
    found = verdicts(text, exercise)
    assert sorted(found) == list(range(world_size)), text
    return found


def reference_answer(lesson: str, exercise: int) -> str:
    """The lesson's reference solution to ``exercise``, under the exercise's own names."""
    reference = lesson_cell(lesson, f"# Reference solution to exercise {exercise}")
    return re.sub(r"\b(\w+)_reference\b", r"\1", reference)


def assert_checker(ip, lesson: str, exercise: int, wrong: str, world_size: int) -> None:
    """The checker fails ``wrong`` on every rank and passes the lesson's reference solution on every rank."""
    assert set(check(ip, lesson, exercise, wrong, world_size).values()) == {"fail"}
    reference = reference_answer(lesson, exercise)
    assert set(check(ip, lesson, exercise, reference, world_size).values()) == {"pass"}


def exercise_cells(lesson: str) -> list[str]:
    """The lesson's code cells from the first exercise's stub to the last reference solution, in order."""
    notebook = nbformat.read(NOTEBOOKS / f"{lesson}.ipynb", as_version=4)
    code = [cell.source for cell in notebook.cells if cell.cell_type == "code"]
    first = next(i for i, source in enumerate(code) if "# Exercise 1: your answer" in source)
    last = max(i for i, source in enumerate(code) if "# Reference solution to exercise" in source)
    return code[first : last + 1]


def run_in_order(ip, lesson: str, answers: dict[int, str]) -> dict[int, dict[int, str]]:
    """Run the lesson's exercise cells in the notebook's order, each stub replaced by ``answers[N]`` (a
    ``%%distributed`` stub stays one); ``{exercise: {rank: "pass" or "fail"}}`` from every checker. A checker
    that runs in the notebook (not on the ranks) counts as rank 0."""
    found: dict[int, dict[int, str]] = {}
    stubs = []
    for source in exercise_cells(lesson):
        if stub := re.search(r"# Exercise (\d+): your answer", source):
            stubs.append(int(stub[1]))
            first = source.partition("\n")[0]
            source = (first + "\n" if first.startswith("%%distributed") else "") + answers[int(stub[1])]
        with capture_output() as captured:
            result = ip.run_cell(source)
        shown = shown_text(captured) if source.startswith("%%distributed") else "[rank 0]\n" + captured.stdout
        assert result.error_in_exec is None and result.error_before_exec is None, (lesson, source, shown)
        if checker := re.search(r"# Checker for exercise (\d+)", source):
            found[int(checker[1])] = verdicts(shown, int(checker[1]))
    assert sorted(stubs) == sorted(answers) == sorted(found), (lesson, stubs, sorted(found))
    return found


def assert_run_all(ip, lesson: str, wrong: dict[int, str], world_size: int) -> None:
    """Run All, with the stubs replaced by ``wrong`` answers, then by the reference solutions: every checker
    says "not yet" to the first and "pass" to the second, on every rank (a notebook checker: rank 0 only)."""
    right = {exercise: reference_answer(lesson, exercise) for exercise in wrong}
    for answers, expected in ((wrong, "fail"), (right, "pass")):
        for exercise, per_rank in run_in_order(ip, lesson, answers).items():
            assert per_rank and set(per_rank) <= set(range(world_size)), (lesson, exercise, per_rank)
            assert set(per_rank.values()) == {expected}, (lesson, exercise, expected, per_rank)
