"""Pictures of communication, drawn with matplotlib from trace events.

- ``draw_trace(trace)``: one step (a collective, or a send with its recv) as rank boxes with
  their values before and after and an arrow for every rank-to-rank movement of data; or, for a
  sequence, a timeline with one lane per rank (:mod:`ddp_magics.timeline`).
- ``save_trace(trace, path)``: the calls as Chrome-trace JSON (:mod:`ddp_magics.chrome_trace`).
- ``draw_step(trace, n)``: step n alone (lessons draw ops that are not run with it: see
  :mod:`ddp_magics.lessons`).

:class:`Trace` is the trace a traced cell leaves in the notebook: the matched calls of
:mod:`ddp_magics.matching`, which it can draw. matplotlib (half a second to import) is imported
when a diagram is first drawn, not with this module.

Each drawing is a :class:`~ddp_magics.figures.Diagram`: an image in a notebook with a
deterministic text form that nbval compares (see :mod:`ddp_magics.figures`).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from ddp_magics.chrome_trace import ChromeTrace
from ddp_magics.figures import (
    MISMATCH_COLOR,
    Diagram,
    draw_arrow,
    draw_box,
    draw_title,
    fit_figure,
    new_figure,
    rank_color,
)
from ddp_magics.matching import COLLECTIVE, MatchedTrace, Step
from ddp_magics.protocol import OPS, RUNNING, TraceEvent, format_values, rank_label
from ddp_magics.timeline import draw_timeline

MAX_BOX_LINES = 8
MAX_STEP_BOXES = 8  # ranks with a box in one step's picture; beyond, runs of ranks share one
BOX_TEXT_WIDTH = 20
LINE_HEIGHT = 0.2  # one line of box text, in data units


class Trace(MatchedTrace):
    """The ranks' calls of one cell, matched (see :class:`~ddp_magics.matching.MatchedTrace`),
    and drawn on demand."""

    def draw(self, step: int | None = None, timeline: bool | None = None) -> Diagram:
        """A diagram: one step (``step=N``, numbered as in the listing) or the timeline."""
        return draw_trace(self, step=step, timeline=timeline)

    def save(self, path) -> Path:
        """Chrome-trace JSON (Perfetto, ``chrome://tracing``, HTA): one process per rank named
        ``rank N``, each call a slice from its start to its end, its arguments as the slice's.
        ``path``: a ``.json`` file, every rank in it; or a directory, one file per rank with
        its ``distributedInfo`` (rank, world size, backend), as HTA's ``TraceAnalysis`` reads."""
        return save_trace(self, path)


def save_trace(trace: MatchedTrace, path) -> Path:
    starts = [event.start for events in trace.events.values() for event in events if event.start]
    chrome = ChromeTrace(min(starts, default=0.0))
    for rank, events in trace.events.items():
        chrome.rank(rank)
        for event in events:
            end = event.end if event.end is not None else max(event.start, chrome.origin)
            chrome.slice(rank, "calls", event.what(), event.start, end, "communication", _event_args(event))
    events = [event for rank_events in trace.events.values() for event in rank_events]
    world = max((rank for event in events for rank in (event.rank, *event.group)), default=-1) + 1
    backends = {
        rank: next((e.backend for e in trace.events[rank] if e.backend), "unknown") for rank in trace.events
    }
    ranks = {rank: {"rank": rank, "world_size": world, "backend": backends[rank]} for rank in trace.events}
    return chrome.save(path, {"source": "ddp_magics --trace"}, ranks)


def _event_args(event: TraceEvent) -> dict:
    args = {
        "call": event.call(),
        "seq": event.seq,
        "group": list(event.group),
        "status": event.status,
        "line": event.line,
        "made_by": event.made_by,
        "mesh_dim": event.mesh_dim,
    }
    if event.primary is not None:
        args["shape"], args["dtype"] = list(event.primary.shape), event.primary.dtype
    if event.before:
        args["before"] = format_values(event.before)
    if event.after is not None:
        args["after"] = format_values(event.after)
    if event.error:
        args["error"] = event.error
    return {key: value for key, value in args.items() if value is not None}


# --------------------------------------------------------------------------- entry points
def draw_trace(trace: MatchedTrace, step: int | None = None, timeline: bool | None = None) -> Diagram:
    """Step ``step`` (numbered as in ``trace``'s listing) or, by default, the only step if there
    is one and the timeline otherwise."""
    if step is not None:
        if not 1 <= step <= len(trace.steps):
            raise ValueError(f"step {step}: this trace has steps 1-{len(trace.steps)}")
        return draw_step(trace, step)
    if timeline is None:
        timeline = len(trace.steps) != 1
    return draw_timeline(trace) if timeline else draw_step(trace, 1)


# --------------------------------------------------------------------------- one step
def draw_step(trace: MatchedTrace, number: int) -> Diagram:
    step = trace.steps[number - 1]
    ranks = sorted(set(step.group) | set(step.events)) if step.kind == COLLECTIVE else step.ranks
    mismatches = [m for m in trace.mismatches if any(m.involves(e) for e in step.events.values())]
    drawn = _drawn_ranks(step, ranks, mismatches)
    columns = {item: index * 2.0 for index, item in enumerate(drawn)}
    shown = [item for item in drawn if isinstance(item, int)]
    boxes = {rank: (_box_text(step, rank, "before"), _box_text(step, rank, "after")) for rank in shown}
    lines = max(len(text.splitlines()) for pair in boxes.values() for text in pair)
    box_height = 0.25 + LINE_HEIGHT * lines
    before_y, after_y = 1.7 + box_height, 0.0

    figure, axes = new_figure()
    for item in drawn:
        if not isinstance(item, int):  # a run of ranks not drawn, one box for it in each row
            text = f"{rank_label(list(item))}\n({len(item)} more)"
            for row, y in (("before", before_y), ("after", after_y)):
                gid = f"{row}:more:{item[0]}-{item[-1]}"
                draw_box(axes, columns[item], y, 1.6, box_height, text, "0.6", gid, dashed=True)
            continue
        event = step.events.get(item)
        missing = event is None
        edge = MISMATCH_COLOR if missing or any(m.involves(event) for m in mismatches) else rank_color(item)
        for row, y in (("before", before_y), ("after", after_y)):
            text = boxes[item][0 if row == "before" else 1]
            draw_box(axes, columns[item], y, 1.6, box_height, text, edge, f"{row}:{item}", dashed=missing)
    everyone = len(step.events) > 2 and len(step.flows()) == len(step.events) * (len(step.events) - 1)
    if len(shown) < len(ranks) and everyone:  # from every rank to every rank: through one point
        _through_hub(axes, step, shown, columns, before_y - box_height / 2, after_y + box_height / 2)
    else:
        for source, target in step.flows():
            if source not in columns or target not in columns:
                continue
            start, end = (
                (columns[source], before_y - box_height / 2),
                (columns[target], after_y + box_height / 2),
            )
            draw_arrow(axes, start, end, source, f"arrow:{source}->{target}", size=12, width=1.4)
    left = min(columns.values()) - 1.0
    axes.text(left - 0.1, before_y, "before", ha="right", va="center", fontsize=9, color="0.35")
    axes.text(left - 0.1, after_y, "after", ha="right", va="center", fontsize=9, color="0.35")
    _mismatch_footer(axes, mismatches, left, after_y - box_height / 2 - 0.35)
    top = before_y + box_height / 2 + 0.3
    draw_title(axes, (left + max(columns.values())) / 2, top, f"{number}. {step.title()}")
    fit_figure(
        figure,
        axes,
        (left - 0.9, max(columns.values()) + 1.0),
        (after_y - box_height / 2 - 0.5 - 0.45 * len(mismatches), top + 0.3),
    )

    listing = [f"{number}. {step.title()}", *(f"   {line}" for line in step.lines())]
    listing.extend(f"Mismatch: {m.message}" for m in mismatches)
    return Diagram(figure, "\n".join(listing))


def _drawn_ranks(step: Step, ranks: list[int], mismatches: list) -> list:
    """The ranks a step's picture has a box for: all of up to ``MAX_STEP_BOXES``; beyond, the
    first and last few, the root, and every rank missing or in a mismatch, with each run of
    ranks left out as one tuple of them."""
    if len(ranks) <= MAX_STEP_BOXES:
        return list(ranks)
    keep = {*ranks[: MAX_STEP_BOXES // 2], *ranks[-2:]}
    keep.update(
        rank
        for rank in ranks
        if rank not in step.events or any(m.involves(step.events[rank]) for m in mismatches)
    )
    keep.update(event.root for event in step.events.values() if event.root is not None)
    drawn: list = []
    run: list[int] = []
    for rank in ranks:
        if rank in keep:
            if run:
                drawn.append(tuple(run))
                run = []
            drawn.append(rank)
        else:
            run.append(rank)
    if run:
        drawn.append(tuple(run))
    return drawn


def _through_hub(axes, step: Step, shown: list[int], columns: dict, top: float, bottom: float) -> None:
    """Every rank's data reaching every rank (an all-reduce of many ranks), drawn as arrows into
    one point and out of it, instead of one arrow per pair."""
    x = (min(columns.values()) + max(columns.values())) / 2
    y = (top + bottom) / 2
    axes.text(
        x,
        y,
        f"{step.op}\n{rank_label(step.ranks)}",
        ha="center",
        va="center",
        fontsize=8.5,
        bbox={"boxstyle": "round,pad=0.3", "facecolor": "#eef3fb", "edgecolor": "0.6"},
        gid="hub",
    )
    for rank in shown:
        for start, end, gid in (
            ((columns[rank], top), (x, y + 0.25), f"arrow:{rank}->hub"),
            ((x, y - 0.25), (columns[rank], bottom), f"arrow:hub->{rank}"),
        ):
            draw_arrow(axes, start, end, rank, gid, size=10, width=1.1)


def _box_text(step: Step, rank: int, row: str) -> str:
    event = step.events.get(rank)
    lines = [f"rank {rank}"]
    if event is None:
        missing = "died, calls\nunknown" if rank in step.lost else "never called"
        lines.append(missing if row == "before" else "")
        return "\n".join(lines)
    if row == "before":
        values = event.before
    elif event.status == RUNNING:
        values = None
    elif event.op in OPS and not OPS[event.op].outputs:
        values = event.before  # a send keeps its data
    else:
        values = event.after
    if event.op != step.op and step.kind == COLLECTIVE and row == "before":
        lines.append(f"called {event.op}")
    lines.extend(_value_lines(values, still_running=event.status == RUNNING))
    return "\n".join(lines)


def _value_lines(infos, still_running: bool = False) -> list[str]:
    if infos is None:
        return ["(still running)" if still_running else "?"]
    if not infos:
        return ["-"]
    lines = [line for info in infos for line in textwrap.wrap(info.describe(), BOX_TEXT_WIDTH)]
    if len(lines) > MAX_BOX_LINES:
        lines = [*lines[: MAX_BOX_LINES - 1], f"... {len(lines) - MAX_BOX_LINES + 1} more lines"]
    return lines


def _mismatch_footer(axes, mismatches, x, y) -> None:
    for index, mismatch in enumerate(mismatches):
        axes.text(
            x,
            y - 0.45 * index,
            "\n".join(textwrap.wrap(f"Mismatch: {mismatch.message}", 110)),
            ha="left",
            va="top",
            fontsize=8.5,
            color=MISMATCH_COLOR,
            gid=f"mismatch:{index}",
        )
