"""Tracing changes nothing a lesson computes: every lesson with traced cells (``--diagram``,
``--trace NAME``) runs here with those options taken out, in a real kernel, and every output that
is not the trace itself equals the committed one, which nbval checks against the traced run.

Cells that read a trace (``NAME.steps``, ``NAME.draw()``) are left out, and so are cells whose
output nbval does not compare (``nbval-ignore-output``). A cell's printed text and values are
compared; for a cell that raised, its error's name (a traced hang report also names the traced
call and the mismatch, which an untraced one cannot).
"""

from __future__ import annotations

import re
import signal
from contextlib import contextmanager
from pathlib import Path

import nbformat
import pytest
from jupyter_client.kernelspec import NoSuchKernel
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
TRACED = re.compile(r"^%%distributed\b.*--(trace|diagram)\b", re.MULTILINE)
TRACE_NAME = re.compile(r"--trace\s+([A-Za-z_]\w*)")
LIVE_VIEW = "application/vnd.jupyter.widget-view+json"
OPTIONS = re.compile(r"\s--diagram\b|\s--trace\s+[A-Za-z_]\w*")


@contextmanager
def signal_handling_kept():
    """nbclient handles SIGINT and SIGTERM (asyncio signal handlers, with the loop's wakeup fd) while
    it runs a notebook, and leaves them set when the kernel fails to start (nbclient 0.11,
    ``async_setup_kernel``: they are removed in a ``finally`` entered only once the kernel
    answered). The worker's Ctrl-C and SIGTERM, and those of processes forked from it later, would
    then do nothing (seen: a test's SIGTERMed child that lived on)."""
    handlers = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
    wakeup_fd = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(wakeup_fd)
    try:
        yield
    finally:
        for number, handler in handlers.items():
            signal.signal(number, handler)
        signal.set_wakeup_fd(wakeup_fd)


def lessons_with_traces() -> list[str]:
    return sorted(
        path.stem
        for path in NOTEBOOKS.glob("*.ipynb")
        if any(
            cell.cell_type == "code" and TRACED.search(cell.source)
            for cell in nbformat.read(path, as_version=4).cells
        )
    )


def compared(outputs: list) -> list[str]:
    """What nbval would compare of a cell's outputs, less diagrams (a trace's, or a rank's
    figure: traced cells draw theirs)."""
    kept = []
    for output in outputs:
        if output.output_type == "stream":  # as nbval reads it: a stream's pieces joined
            text = output.text.replace("\r\n", "\n")
            if kept and kept[-1].startswith(f"{output.name}: "):
                kept[-1] += text
            else:
                kept.append(f"{output.name}: {text}")
        elif output.output_type == "error":
            kept.append(f"error: {output.ename}")
        elif set(output.get("data", {})) <= {LIVE_VIEW}:  # the live view, which nbval skips too
            continue
        elif "image/png" not in output.get("data", {}):  # a diagram (a figure's text is nbval's)
            kept.append(f"{output.output_type}: {output.get('data', {}).get('text/plain', '')}")
    return kept


@pytest.mark.parametrize("lesson", lessons_with_traces())
def test_a_lesson_untraced_computes_what_it_did_traced(lesson, tmp_path):
    committed = nbformat.read(NOTEBOOKS / f"{lesson}.ipynb", as_version=4)
    names = {name for cell in committed.cells for name in TRACE_NAME.findall(cell.source)}
    reads_a_trace = re.compile(rf"\b({'|'.join(map(re.escape, names))})\b") if names else None
    untraced = nbformat.read(NOTEBOOKS / f"{lesson}.ipynb", as_version=4)
    checked = []
    for index, cell in enumerate(untraced.cells):
        if cell.cell_type != "code":
            continue
        first, newline, rest = cell.source.partition("\n")
        if first.startswith("%%distributed"):
            cell.source = OPTIONS.sub("", first) + newline + rest
        elif reads_a_trace and reads_a_trace.search(cell.source):
            cell.source = "pass  # reads a trace"
            continue
        if "nbval-ignore-output" not in cell.metadata.get("tags", []):
            checked.append(index)
    with signal_handling_kept():
        NotebookClient(
            untraced,
            kernel_name="python3",
            timeout=120,
            allow_errors=True,
            # In a folder of its own: nbval runs the same lesson in notebooks/ meanwhile, and a lesson
            # writes (and removes) its scripts and checkpoints where it runs.
            resources={"metadata": {"path": str(tmp_path)}},
        ).execute()
    differences = [
        (index, compared(committed.cells[index].outputs), compared(untraced.cells[index].outputs))
        for index in checked
        if compared(committed.cells[index].outputs) != compared(untraced.cells[index].outputs)
    ]
    if differences:  # in full: pytest would cut a long assertion's values short
        shown = [f"cell {i}:\n  traced:   {was!r}\n  untraced: {now!r}" for i, was, now in differences]
        pytest.fail("\n".join(shown))


def test_a_kernel_that_fails_to_start_leaves_signal_handling_as_it_was():
    before = [signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)]
    with pytest.raises(NoSuchKernel), signal_handling_kept():
        NotebookClient(nbformat.v4.new_notebook(), kernel_name="no-such-kernel").execute()
    assert [signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)] == before
