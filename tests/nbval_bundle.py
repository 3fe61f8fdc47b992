"""A pytest plugin (loaded by pyproject's addopts): nbval skips the rank view's MIME type.

A ``%%distributed`` cell's first rank block carries, beside its ``text/plain`` and ``text/html``,
the rank view's record under ``application/vnd.ddp-magics.ranks+json`` (``ddp_magics.lab_bundle``)
for JupyterLab's extension. nbval compares every data key not in its ``skip_compare``: without
this, a lesson whose committed outputs predate the record would fail with "Unexpected output
fields". The record says nothing the text does not (the text is still compared, as before), so
it is added to the keys nbval skips, as nbval skips widget views.
"""

from __future__ import annotations

RANK_VIEW_MIMETYPE = "application/vnd.ddp-magics.ranks+json"


def pytest_collectstart(collector) -> None:
    try:
        from nbval.plugin import IPyNbFile
    except ImportError:  # nbval not installed: nothing to do
        return
    if isinstance(collector, IPyNbFile) and RANK_VIEW_MIMETYPE not in collector.skip_compare:
        collector.skip_compare = (*collector.skip_compare, RANK_VIEW_MIMETYPE)
