"""The rank view's data: a cell's outcome as plain per-rank records, under a MIME type of ours.

JupyterLab's extension (``labextension/``) renders it as tabs, one per rank or per group of
ranks whose output and state are identical, and a compare grid. The record goes into the bundle
of the cell's first rank-block display, beside its ``text/plain`` and ``text/html``, which stay
as they were: a front end without the extension (nbval, VS Code, classic Notebook, GitHub)
shows those. Nothing here reads the clock, a PID or a host: the record is as deterministic as
the text.
"""

from __future__ import annotations

import json

from ddp_magics.output import MAX_SHOWN_CHARS, tail
from ddp_magics.protocol import rank_label

MIMETYPE = "application/vnd.ddp-magics.ranks+json"
VERSION = 1
# Rich displays (figures) go in the record up to this many bytes of JSON together; past it the
# record says so and the displays are shown only where they are today, after their rank's block.
MAX_DISPLAY_BYTES = 2_000_000
# The metadata key of the cell's other outputs that the rank view shows already (the extension
# hides them; nbval skips metadata).
SHOWN_IN_RANK_VIEW = {"ddp_magics": {"in_rank_view": True}}

FINISHED, RAISED, HUNG, RELEASED, DEAD, STOPPED = "finished", "raised", "hung", "released", "dead", "stopped"


def _where(blocked) -> dict:
    return {
        "line": blocked.cell_line,
        "code": blocked.source_line,
        "call": blocked.traced_call or blocked.dist_call,
        "text": blocked.where(),
    }


def rank_records(outcome, max_lines: int) -> list[dict]:
    """One record per rank the cell ran on, in rank order: its state (and where it waits or what
    it raised), what it printed (cut as the text form cuts it) and what it displayed."""
    outputs = {output.rank: output for output in outcome.outputs}
    failures = {failure.rank: failure for failure in outcome.failures}
    blocked = {item.rank: item for item in outcome.blocked}
    released = {item.rank: item for item in outcome.released}
    interrupted = outcome.ended == "interrupt"
    records = []
    for rank in sorted(outcome.ranks):
        output = outputs.get(rank)
        record: dict = {
            "rank": rank,
            "state": FINISHED,
            "stdout": tail(output.stdout, max_lines) if output else "",
            "stderr": tail(output.stderr, max_lines) if output else "",
            "result": tail(output.result_text, None, MAX_SHOWN_CHARS) if output else "",
            "displays": [_plain_display(item) for item in output.rich_displays] if output else [],
            "error": None,
            "where": None,
        }
        if rank in outcome.dead or (rank in failures and failures[rank].engine_died):
            record["state"] = DEAD
        elif rank in failures:
            record["state"] = RAISED
            record["error"] = {"ename": failures[rank].ename, "evalue": failures[rank].evalue}
        elif rank in released:
            record["state"] = RELEASED
            record["where"] = _where(released[rank])
        elif rank in blocked:
            record["state"] = STOPPED if interrupted else HUNG
            record["where"] = _where(blocked[rank])
        records.append(record)
    return records


def _plain_display(item: dict) -> dict:
    return {"data": dict(item.get("data", {})), "metadata": dict(item.get("metadata", {}))}


def _signature(record: dict) -> str:
    shown = {key: value for key, value in record.items() if key != "rank"}
    if shown["where"]:
        shown["where"] = {key: value for key, value in shown["where"].items()}
    return json.dumps(shown, sort_keys=True, default=str)


def rank_view(outcome, collapse: bool, max_lines: int) -> dict | None:
    """The record for the rank view: ``ranks`` (one record each) and ``groups`` (ranks whose
    record is identical but for the number, when ``collapse``; rank 0's group first), or None
    for a cell that ran on no rank."""
    records = rank_records(outcome, max_lines)
    if not records:
        return None
    displays_below = len(json.dumps([r["displays"] for r in records], default=str)) > MAX_DISPLAY_BYTES
    if displays_below:
        for record in records:
            record["displays_below"] = len(record["displays"])
            record["displays"] = []
    groups: dict[str, list[int]] = {}
    for record in records:
        key = _signature(record) if collapse else str(record["rank"])
        groups.setdefault(key, []).append(record["rank"])
    return {
        "version": VERSION,
        "ranks": records,
        "groups": [{"ranks": ranks, "label": rank_label(ranks)} for ranks in groups.values()],
        "displays_below": displays_below,
    }
