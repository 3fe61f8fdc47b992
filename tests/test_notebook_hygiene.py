"""The committed lessons hold what a reader needs and nothing that changes at every run."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[path.stem for path in NOTEBOOKS])
def test_no_execution_timestamps_or_widget_state(path):
    notebook = nbformat.read(path, as_version=4)
    timed = [index for index, cell in enumerate(notebook.cells) if "execution" in cell.metadata]
    assert timed == [], f"cells with execution timestamps: {timed} (run scripts/execute_notebooks.py)"
    assert "widgets" not in notebook.metadata, "saved widget state (run scripts/execute_notebooks.py)"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[path.stem for path in NOTEBOOKS])
def test_stored_stacks_carry_no_line_numbers_of_installed_code(path):
    """A hang report's frames outside the cell name file and function only: a torch patch release
    must not change a lesson's stored output."""
    frames = [
        line.strip()
        for line in _output_lines(nbformat.read(path, as_version=4))
        if line.strip().startswith(('File "torch/', 'File "ddp_magics/'))
    ]
    assert [frame for frame in frames if ", line " in frame] == []


def _output_lines(notebook) -> list[str]:
    lines = []
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            texts = [output.get("text", ""), *output.get("traceback", [])]
            texts += [str(value) for value in output.get("data", {}).values()]
            lines += [re.sub(r"\x1b\[[0-9;]*m", "", line) for text in texts for line in text.splitlines()]
    return lines


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[path.stem for path in NOTEBOOKS])
def test_reference_solutions_are_collapsed_so_learners_try_first(path):
    """One convention in every lesson: a reference solution's code is hidden until the reader opens it
    (its output, and the checker after it, stay visible)."""
    notebook = nbformat.read(path, as_version=4)
    solutions = [cell for cell in notebook.cells if "# Reference solution" in cell.source]
    hidden = [cell.metadata.get("jupyter", {}).get("source_hidden", False) for cell in solutions]
    assert solutions and all(hidden), [cell.source.splitlines()[1] for cell in solutions]
