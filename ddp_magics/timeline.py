"""The timeline of a traced cell: one lane per rank, each call a box in its column of time, an
arrow from each send to its recv (see :func:`draw_timeline`)."""

from __future__ import annotations

import textwrap

from ddp_magics import figures
from ddp_magics.matching import COLLECTIVE, TRANSFER, MatchedTrace, Step
from ddp_magics.protocol import OPS, RUNNING, WAIT, TraceEvent, format_values, plural, rank_label

MAX_TIMELINE_STEPS = 30  # in the text listing
MAX_TIMELINE_COLUMNS = 16
COLUMN_WIDTH, EVENT_WIDTH = 1.75, 1.45
MAX_TIMELINE_RANKS = 8


def draw_timeline(trace: MatchedTrace) -> figures.Diagram:
    """One lane per rank, time left to right. A long trace draws each run of repeated steps once
    (a box says ``3 x50``: step 3, fifty times), then its first columns, and says so."""
    from matplotlib.patches import FancyBboxPatch

    full, labels = trace, {}
    if len(trace.steps) > MAX_TIMELINE_COLUMNS and trace.repeats():
        trace, labels = trace.condensed()
    lanes = {rank: index for index, rank in enumerate(trace.ranks[:MAX_TIMELINE_RANKS])}
    numbered = list(enumerate(trace.steps, 1))
    shown = [(n, step) for n, step in numbered if step.column < MAX_TIMELINE_COLUMNS]
    last_column = max((c for _, step in shown for c in step.columns.values()), default=0)
    last_column = min(last_column, MAX_TIMELINE_COLUMNS - 1)
    notes = _timeline_notes(full, lanes, len(numbered) - len(shown), repeated=bool(labels))
    figure, axes = figures.new_figure()

    def x_of(column: int) -> float:
        return column * COLUMN_WIDTH

    def y_of(rank: int) -> float:
        return -1.0 * lanes[rank]

    right = x_of(last_column) + 1.0
    for rank in lanes:
        axes.plot([-0.9, right], [y_of(rank)] * 2, color="0.85", linewidth=1, zorder=0)
        axes.text(
            -1.0,
            y_of(rank),
            f"rank {rank}",
            ha="right",
            va="center",
            fontsize=9,
            color=figures.rank_color(rank),
        )
    for number, step in shown:
        drawn = {
            r: e for r, e in step.events.items() if r in lanes and step.columns[r] < MAX_TIMELINE_COLUMNS
        }
        members = [rank for rank in step.group if rank in lanes]
        if step.kind == COLLECTIVE and members:
            x = x_of(step.column)
            # One band per run of adjacent lanes: a group like ranks 0,2 must not cover rank 1's lane,
            # where another group's collective may sit in the same column.
            for run in _adjacent_runs(sorted(lanes[rank] for rank in members)):
                top, bottom = -1.0 * run[0], -1.0 * run[-1]
                axes.add_patch(
                    FancyBboxPatch(
                        (x - 0.75, bottom - 0.4),
                        1.5,
                        top - bottom + 0.8,
                        boxstyle="round,pad=0.02",
                        facecolor="#eef3fb",
                        edgecolor="none",
                        zorder=1,
                        gid=f"collective:{number}",
                    )
                )
        for rank, event in drawn.items():
            mismatched = any(m.involves(event) for m in trace.mismatches)
            edge = figures.MISMATCH_COLOR if mismatched else figures.rank_color(rank)
            label = f"{labels.get((rank, event.seq), number)} {_short_op(event)}\n{_short_values(event)}"
            who = " ".join(
                part for part in (f"[{event.mesh_dim}]" if event.mesh_dim else "", event.made_by) if part
            )
            if who:  # who made it, on which mesh dimension (the listing names the makers too)
                label += "\n" + textwrap.shorten(who, 22, placeholder="...")
            x, y = x_of(step.columns[rank]), y_of(rank)
            figures.draw_box(
                axes, x, y, EVENT_WIDTH, 0.62, label, edge, f"event:{rank}:{event.seq}", fontsize=7.5
            )
        if (
            step.kind == TRANSFER
            and step.send
            and step.recv
            and {step.send.rank, step.recv.rank} <= set(drawn)
        ):
            _transfer_arrow(axes, step, number, x_of, y_of)
    bottom = -1.0 * (len(lanes) - 1) - 0.55
    for index, note in enumerate(notes):
        is_mismatch = note.startswith("Mismatch")
        axes.text(
            -1.0,
            bottom - 0.3 - 0.4 * index,
            note,
            ha="left",
            va="top",
            fontsize=8.5,
            color=figures.MISMATCH_COLOR if is_mismatch else "0.3",
            gid=f"{'mismatch' if is_mismatch else 'note'}:{index}",
        )
    complete = "" if full.complete else " (cell not finished)"
    figures.draw_title(
        axes, right / 2, 0.75, f"{plural(len(full.steps), 'step')} on {rank_label(full.ranks)}{complete}"
    )
    figures.fit_figure(figure, axes, (-2.4, right + 0.2), (bottom - 0.4 - 0.4 * len(notes), 1.05))
    return figures.Diagram(figure, full.text(MAX_TIMELINE_STEPS))


def _transfer_arrow(axes, step: Step, number: int, x_of, y_of) -> None:
    """From the send's box to the recv's box: straight down (or up) when they share a column."""
    send, recv = step.send, step.recv
    x_send, x_recv = x_of(step.columns[send.rank]), x_of(step.columns[recv.rank])
    y_send, y_recv = y_of(send.rank), y_of(recv.rank)
    down = 1 if y_recv < y_send else -1
    if x_send == x_recv:
        start = (x_send + EVENT_WIDTH / 2 - 0.12, y_send - 0.31 * down)
        end = (x_recv + EVENT_WIDTH / 2 - 0.12, y_recv + 0.31 * down)
    else:
        start = (x_send + EVENT_WIDTH / 2, y_send - 0.2 * down)
        end = (x_recv - EVENT_WIDTH / 2, y_recv + 0.2 * down)
    gid = f"arrow:{send.rank}->{recv.rank}:{number}"
    figures.draw_arrow(axes, start, end, send.rank, gid, size=11, width=1.3, zorder=3)


def _timeline_notes(trace: MatchedTrace, lanes: dict[int, int], not_drawn: int, repeated: bool) -> list[str]:
    notes = []
    if repeated:
        notes.append("Repeated steps drawn once: 'N xT' is step N of the listing, T times in a row")
    if not_drawn:
        notes.append(f"... {plural(not_drawn, 'more step')} not drawn; all steps: {trace.summary()}")
    hidden = [rank for rank in trace.ranks if rank not in lanes]
    if hidden:
        notes.append(f"ranks {hidden[0]}-{hidden[-1]} not drawn (first {MAX_TIMELINE_RANKS} ranks shown)")
    notes.extend(
        textwrap.shorten(f"Mismatch: {mismatch.message}", 160, placeholder=" ...")
        for mismatch in trace.mismatches
    )
    return notes


def _adjacent_runs(indices: list[int]) -> list[list[int]]:
    """[0, 1, 3] -> [[0, 1], [3]]"""
    runs: list[list[int]] = []
    for index in indices:
        if runs and index == runs[-1][-1] + 1:
            runs[-1].append(index)
        else:
            runs.append([index])
    return runs


def _short_op(event: TraceEvent) -> str:
    if event.op == WAIT:
        return "wait"
    if event.op in ("send", "isend"):
        return f"{event.op}→{event.peer}"
    if event.op in ("recv", "irecv"):
        return f"{event.op}←{'?' if event.peer is None else event.peer}"
    name = event.op.replace("_into_tensor", "_into_t").replace("reduce_scatter", "red_scatter")
    if event.reduce_op and event.reduce_op != "SUM":
        name += f" {event.reduce_op}"
    return name


def _short_values(event: TraceEvent) -> str:
    if event.status == RUNNING:
        return "running..."
    infos = event.after if event.op in OPS and OPS[event.op].outputs else event.before
    return textwrap.shorten(format_values(infos), 18, placeholder="...")
