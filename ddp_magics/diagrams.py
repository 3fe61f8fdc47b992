"""Pictures of communication, drawn with matplotlib from trace events.

- ``draw_trace(trace)``: one step (a collective, or a send with its recv) as rank boxes with
  their values before and after and an arrow for every rank-to-rank movement of data; or, for a
  sequence, a timeline with one lane per rank.
- ``draw_step(trace, n)``: step n alone (lessons draw ops that are not run with it: see
  :mod:`ddp_magics.lessons`).

:class:`Trace` is the trace a traced cell leaves in the notebook: the matched calls of
:mod:`ddp_magics.matching`, which it can draw. matplotlib (half a second to import) is imported
when a diagram is first drawn, not with this module.

Each :class:`Diagram` shows as an image in a notebook and has a deterministic text form (the
listing of ops and values) that nbval compares. Artists carry gids (``before:0``,
``arrow:0->1``, ``event:1:3``, ...) so tests can check what was drawn.
"""

from __future__ import annotations

import io
import textwrap
from typing import TYPE_CHECKING

from ddp_magics.matching import COLLECTIVE, TRANSFER, MatchedTrace, Step
from ddp_magics.protocol import OPS, RUNNING, WAIT, TraceEvent, format_values, plural, rank_label

if TYPE_CHECKING:
    from matplotlib.figure import Figure

MAX_TIMELINE_STEPS = 30  # in the text listing
MAX_TIMELINE_COLUMNS = 16
COLUMN_WIDTH, EVENT_WIDTH = 1.75, 1.45
MAX_TIMELINE_RANKS = 8
MAX_BOX_LINES = 8
MAX_STEP_BOXES = 8  # ranks with a box in one step's picture; beyond, runs of ranks share one
BOX_TEXT_WIDTH = 20
# Inches per data unit: the axes fill the figure, so text (in points) and boxes (in data units)
# keep their proportions whatever the number of ranks.
INCHES_PER_X, INCHES_PER_Y = 0.95, 0.75
LINE_HEIGHT = 0.2  # one line of box text, in data units
MISMATCH_COLOR = "#c62828"
RANK_COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22"]


def rank_color(rank: int) -> str:
    return RANK_COLORS[rank % len(RANK_COLORS)]


class Diagram:
    """A figure and the text that describes it (what nbval compares)."""

    def __init__(self, figure: Figure, text: str) -> None:
        self.figure = figure
        self.text = text

    def artists(self, prefix: str = "") -> list:
        """The drawn artists whose gid starts with ``prefix`` (``arrow:``, ``before:``, ...)."""
        axes = self.figure.axes[0]
        return [
            artist
            for artist in (*axes.patches, *axes.texts)
            if (artist.get_gid() or "").startswith(prefix) and artist.get_gid()
        ]

    def gids(self, prefix: str = "") -> list[str]:
        return [artist.get_gid() for artist in self.artists(prefix)]

    def _repr_png_(self) -> bytes:
        buffer = io.BytesIO()
        self.figure.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
        return buffer.getvalue()

    def _repr_pretty_(self, printer, cycle: bool) -> None:
        printer.text(self.text)

    def __repr__(self) -> str:
        return self.text


class Trace(MatchedTrace):
    """The ranks' calls of one cell, matched (see :class:`~ddp_magics.matching.MatchedTrace`),
    and drawn on demand."""

    def draw(self, step: int | None = None, timeline: bool | None = None) -> Diagram:
        """A diagram: one step (``step=N``, numbered as in the listing) or the timeline."""
        return draw_trace(self, step=step, timeline=timeline)


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

    figure, axes = _figure()
    for item in drawn:
        if not isinstance(item, int):  # a run of ranks not drawn, one box for it in each row
            text = f"{rank_label(list(item))}\n({len(item)} more)"
            for row, y in (("before", before_y), ("after", after_y)):
                gid = f"{row}:more:{item[0]}-{item[-1]}"
                _box(axes, columns[item], y, 1.6, box_height, text, "0.6", gid, dashed=True)
            continue
        event = step.events.get(item)
        missing = event is None
        edge = MISMATCH_COLOR if missing or any(m.involves(event) for m in mismatches) else rank_color(item)
        for row, y in (("before", before_y), ("after", after_y)):
            text = boxes[item][0 if row == "before" else 1]
            _box(axes, columns[item], y, 1.6, box_height, text, edge, f"{row}:{item}", dashed=missing)
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
            _arrow(axes, start, end, source, f"arrow:{source}->{target}", size=12, width=1.4)
    left = min(columns.values()) - 1.0
    axes.text(left - 0.1, before_y, "before", ha="right", va="center", fontsize=9, color="0.35")
    axes.text(left - 0.1, after_y, "after", ha="right", va="center", fontsize=9, color="0.35")
    _mismatch_footer(axes, mismatches, left, after_y - box_height / 2 - 0.35)
    top = before_y + box_height / 2 + 0.3
    _title(axes, (left + max(columns.values())) / 2, top, f"{number}. {step.title()}")
    _fit(
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
            _arrow(axes, start, end, rank, gid, size=10, width=1.1)


def _arrow(axes, start, end, rank: int, gid: str, size: float, width: float, zorder=None) -> None:
    """An arrow in ``rank``'s colour: data moving from ``start`` to ``end``."""
    from matplotlib.patches import FancyArrowPatch

    axes.add_patch(
        FancyArrowPatch(
            start,
            end,
            arrowstyle="-|>",
            mutation_scale=size,
            color=rank_color(rank),
            linewidth=width,
            shrinkA=2,
            shrinkB=2,
            zorder=zorder,
            gid=gid,
        )
    )


def _figure() -> tuple[Figure, object]:
    from matplotlib.figure import Figure

    figure = Figure()
    axes = figure.add_axes((0, 0, 1, 1))
    axes.set_axis_off()
    return figure, axes


def _fit(figure: Figure, axes, xlim: tuple[float, float], ylim: tuple[float, float]) -> None:
    """Show ``xlim`` x ``ylim`` at a fixed scale; text outside it widens the saved image."""
    axes.set_xlim(*xlim)
    axes.set_ylim(*ylim)
    figure.set_size_inches((xlim[1] - xlim[0]) * INCHES_PER_X, (ylim[1] - ylim[0]) * INCHES_PER_Y)


def _title(axes, x: float, y: float, text: str) -> None:
    axes.text(x, y, text, ha="center", va="center", fontsize=11, gid="title")


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


def _box(axes, x, y, width, height, text, edge, gid, dashed=False, fontsize=8.5) -> None:
    from matplotlib.patches import FancyBboxPatch

    axes.add_patch(
        FancyBboxPatch(
            (x - width / 2, y - height / 2),
            width,
            height,
            boxstyle="round,pad=0.04",
            facecolor="white",
            edgecolor=edge,
            linewidth=1.5,
            linestyle="--" if dashed else "-",
            gid=gid,
        )
    )
    axes.text(x, y, text, ha="center", va="center", fontsize=fontsize, family="monospace", gid=f"text:{gid}")


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


# --------------------------------------------------------------------------- a sequence
def draw_timeline(trace: MatchedTrace) -> Diagram:
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
    figure, axes = _figure()

    def x_of(column: int) -> float:
        return column * COLUMN_WIDTH

    def y_of(rank: int) -> float:
        return -1.0 * lanes[rank]

    right = x_of(last_column) + 1.0
    for rank in lanes:
        axes.plot([-0.9, right], [y_of(rank)] * 2, color="0.85", linewidth=1, zorder=0)
        axes.text(
            -1.0, y_of(rank), f"rank {rank}", ha="right", va="center", fontsize=9, color=rank_color(rank)
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
            edge = MISMATCH_COLOR if mismatched else rank_color(rank)
            label = f"{labels.get((rank, event.seq), number)} {_short_op(event)}\n{_short_values(event)}"
            x, y = x_of(step.columns[rank]), y_of(rank)
            _box(axes, x, y, EVENT_WIDTH, 0.62, label, edge, f"event:{rank}:{event.seq}", fontsize=7.5)
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
            color=MISMATCH_COLOR if is_mismatch else "0.3",
            gid=f"{'mismatch' if is_mismatch else 'note'}:{index}",
        )
    complete = "" if full.complete else " (cell not finished)"
    _title(axes, right / 2, 0.75, f"{plural(len(full.steps), 'step')} on {rank_label(full.ranks)}{complete}")
    _fit(figure, axes, (-2.4, right + 0.2), (bottom - 0.4 - 0.4 * len(notes), 1.05))
    return Diagram(figure, full.text(MAX_TIMELINE_STEPS))


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
    _arrow(axes, start, end, send.rank, gid, size=11, width=1.3, zorder=3)


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
