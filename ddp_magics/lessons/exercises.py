"""The verdict every exercise checker of the lessons prints, the same way on every rank.

A lesson's exercise has three cells: the learner's stub (it keeps the exercise's names, and until it is
answered a function in it raises ``NotImplementedError``), the checker, which tests those names, and a
reference solution after the checker, under names ending in ``_reference``, so that running all cells never
checks the reference in place of the learner's answer.

    verdict(2, check_count)

prints ``exercise 2: pass`` when ``check_count()`` returns ``True``; otherwise ``exercise 2: not yet: ...``
with the string ``check_count()`` returned, the stub's message, or a general hint.
"""

from __future__ import annotations

from collections.abc import Callable

NOT_YET = "the checker's test does not pass yet; read the exercise again, or compare with the reference"


def verdict(exercise: int, check: Callable[[], object]) -> None:
    """Run ``check()`` and print this rank's verdict for ``exercise`` (nothing is returned, so a checker cell
    ending with this call shows no value).

    ``check`` returns ``True`` (pass), or a string that says what is not right yet, or anything else
    (not yet). A stub that still raises ``NotImplementedError`` is reported with its message; any
    other exception goes up to the learner with its traceback.
    """
    try:
        result = check()
    except NotImplementedError as stub:
        result = str(stub) or "the stub is not answered yet"
    if result is True:
        print(f"exercise {exercise}: pass")
        return
    print(f"exercise {exercise}: not yet: {result if isinstance(result, str) and result else NOT_YET}")
