"""tests/nbval_bundle.py: nbval skips the rank view's record, and still compares the text."""

from __future__ import annotations

from types import SimpleNamespace

import nbformat
from nbval.plugin import IPyNbCell, IPyNbFile

from ddp_magics import lab_bundle
from tests import nbval_bundle


def _skips() -> tuple:
    notebook = object.__new__(IPyNbFile)  # no collection: only the attribute the hook changes
    notebook.skip_compare = ("metadata", "application/vnd.jupyter.widget-view+json")
    nbval_bundle.pytest_collectstart(notebook)
    nbval_bundle.pytest_collectstart(notebook)  # twice: added once
    return notebook.skip_compare


def _same(test: list[dict], ref: list[dict]) -> bool:
    cell = SimpleNamespace(
        parent=SimpleNamespace(skip_compare=_skips()),
        colors=SimpleNamespace(FAIL="", ENDC="", OKBLUE="", OKGREEN=""),
        sanitize=lambda text: text,
        comparison_traceback=[],
        format_output_compare=lambda *shown: None,
    )
    return IPyNbCell.compare_outputs(cell, test, ref)


def _display(text: str, record: dict | None = None) -> dict:
    data = {"text/plain": text, "text/html": f"<pre>{text}</pre>"}
    if record is not None:
        data[lab_bundle.MIMETYPE] = record
    return nbformat.NotebookNode({"output_type": "display_data", "data": data, "metadata": {}})


def test_the_record_is_skipped_and_the_text_still_compared():
    assert nbval_bundle.RANK_VIEW_MIMETYPE == lab_bundle.MIMETYPE
    assert _skips().count(lab_bundle.MIMETYPE) == 1
    committed = [_display("[ranks 0,1]\nhello")]
    # A run now adds the record (and marks later outputs in their metadata): still the same.
    assert _same([_display("[ranks 0,1]\nhello", {"ranks": []})], committed)
    later = nbformat.NotebookNode({**_display("x"), "metadata": lab_bundle.SHOWN_IN_RANK_VIEW})
    assert _same([_display("[ranks 0,1]\nhello", {"ranks": []}), later], [*committed, _display("x")])
    # Text that differs still fails.
    assert not _same([_display("[ranks 0,1]\nbye", {"ranks": []})], committed)
