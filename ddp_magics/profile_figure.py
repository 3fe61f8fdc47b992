"""The picture of a :class:`~ddp_magics.profile.Profile`: one lane per rank on the shared clock,
compute above (grey) and communication below (orange, each call named as ``--trace`` names it),
the time each rank spent in ``c10d::`` calls as thin dark marks, and a loop's steps as dashed
lines (its ``record_function`` ranges, else the ranges torch marks each iteration with:
``ProfilerStep#N``, ``DistributedDataParallel.forward``, ``Optimizer.step``). A loop's hundreds
of ranges stay readable: ranges are drawn as bars, and each call's name is written once per
lane, under its first bar, in the first row where it overlaps no other name (measured as drawn)."""

from __future__ import annotations

from ddp_magics.figures import Diagram, rank_color
from ddp_magics.protocol import COMMUNICATION, COMPUTE, LAUNCH, MARK, rank_label

COMPUTE_COLOR, COMMUNICATION_COLOR, LAUNCH_COLOR, MARK_COLOR = "#9e9e9e", "#ef6c00", "#37474f", "#1565c0"
LANE_HEIGHT = 1.3
LABEL_ROWS = 3  # under each lane
MAX_LANES = 16
# Ranges torch opens once per iteration, by the start of their name: step marks where the cell
# has no record_function ranges of its own.
ITERATION_MARKS = ("ProfilerStep#", "DistributedDataParallel.forward", "Optimizer.step#")
LIBRARY_MARKS = (*ITERATION_MARKS, "Optimizer.", "FSDP::", "DDP::", "## ", "PipelineStage")
MAX_MARKS = 200  # per lane


def draw_profile(profile, max_spans: int = 4000) -> Diagram:
    from matplotlib.figure import Figure

    ranks = profile.ranks[:MAX_LANES]
    end = max((span.end for rank in ranks for span in profile.spans[rank]), default=0.0) or 1e-3
    height = 0.9 + 1.2 * len(ranks)
    figure = Figure(figsize=(11, height))
    axes = figure.add_axes((0.1, 0.8 / height, 0.88, 1 - 1.1 / height))
    described, marks = [], step_marks(profile, ranks)
    # The limits first: names are measured where they will be drawn.
    axes.set_ylim(-(len(ranks) - 1) * LANE_HEIGHT - 1.0, 0.8)
    axes.set_xlim(0, end * 1e3 * 1.01)
    labels = _Labels(figure, axes)
    for lane, rank in enumerate(ranks):
        y = -lane * LANE_HEIGHT
        spans = profile.spans[rank][:max_spans]
        rows = {
            COMPUTE: [(s.start * 1e3, s.duration * 1e3) for s in spans if s.kind == COMPUTE],
            COMMUNICATION: [(s.start * 1e3, s.duration * 1e3) for s in spans if s.kind == COMMUNICATION],
            LAUNCH: [(s.start * 1e3, s.duration * 1e3) for s in spans if s.kind == LAUNCH],
        }
        axes.broken_barh(rows[COMPUTE], (y + 0.05, 0.35), color=COMPUTE_COLOR, gid=f"compute:{rank}")
        axes.broken_barh(  # a white edge between calls the backend ran back to back
            rows[COMMUNICATION],
            (y - 0.4, 0.35),
            facecolor=COMMUNICATION_COLOR,
            edgecolor="white",
            linewidth=0.6,
            gid=f"communication:{rank}",
        )
        axes.broken_barh(rows[LAUNCH], (y - 0.02, 0.04), color=LAUNCH_COLOR, gid=f"launch:{rank}")
        lane_marks = marks.get(rank, [])
        axes.vlines(  # one collection per lane
            [mark.start * 1e3 for mark in lane_marks],
            y - 0.42,
            y + 0.5,
            colors=MARK_COLOR,
            linestyles="dashed",
            linewidth=0.8,
            gid=f"marks:{rank}",
        )
        for index, mark in enumerate(lane_marks):
            labels.place(
                mark.start * 1e3, [y + 0.58], _mark_name(mark.name), MARK_COLOR, f"marklabel:{rank}:{index}"
            )
        named = set()
        for index, span in enumerate(spans):
            if span.kind != COMMUNICATION or not span.label:
                continue
            described.append(_short(span))
            if span.label in named:
                continue
            rows_y = [y - 0.45 - 0.17 * row for row in range(LABEL_ROWS)]
            if labels.place(span.start * 1e3, rows_y, _short(span), "black", f"label:{rank}:{index}"):
                named.add(span.label)
    axes.set_yticks([-lane * LANE_HEIGHT for lane in range(len(ranks))])
    axes.set_yticklabels([f"rank {rank}" for rank in ranks])
    for label, rank in zip(axes.get_yticklabels(), ranks):
        label.set_color(rank_color(rank))
    axes.set_xlabel("ms since the profile started (one clock for every rank)")
    axes.set_title("compute (grey, above) and communication (orange, below) per rank", fontsize=10)
    for side in ("top", "right"):
        axes.spines[side].set_visible(False)
    return Diagram(figure, _listing(profile, ranks, described, marks))


def step_marks(profile, ranks: list[int]) -> dict[int, list]:
    """Per rank, where its steps start: the cell's own top-level ``record_function`` ranges if
    it has any, else the range torch opens once per iteration that came most often (twice at
    least); none if neither."""
    spans = {rank: [s for s in profile.spans[rank] if s.kind == MARK] for rank in ranks}
    own = {rank: [s for s in marks if not s.name.startswith(LIBRARY_MARKS)] for rank, marks in spans.items()}
    if any(own.values()):
        return {rank: marks[:MAX_MARKS] for rank, marks in own.items()}
    counts: dict[str, int] = {}
    for marks in spans.values():
        for mark in marks:
            prefix = next((p for p in ITERATION_MARKS if mark.name.startswith(p)), None)
            if prefix is not None:
                counts[prefix] = counts.get(prefix, 0) + 1
    repeated = [prefix for prefix in ITERATION_MARKS if counts.get(prefix, 0) >= 2 * max(len(ranks), 1)]
    if not repeated:
        return {}
    prefix = repeated[0]
    return {
        rank: [s for s in marks if s.name.startswith(prefix)][:MAX_MARKS] for rank, marks in spans.items()
    }


def _mark_name(name: str) -> str:
    return name if len(name) <= 24 else name[:23] + "…"


class _Labels:
    """Names written where they overlap no other, measured as matplotlib draws them."""

    def __init__(self, figure, axes) -> None:
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        self._renderer = FigureCanvasAgg(figure).get_renderer()
        self._axes = axes
        self._placed: list = []

    def place(self, x: float, rows_y: list[float], text: str, color: str, gid: str) -> bool:
        """Write ``text`` from ``x`` in the first row where it fits; False if none."""
        axes = self._axes
        right = axes.get_window_extent(self._renderer).x1
        for y in rows_y:
            artist = axes.text(
                x, y, text, fontsize=7, va="top", ha="left", color=color, clip_on=True, gid=gid
            )
            box = self._box(artist)
            if box.x1 > right:  # past the end of the time axis: moved back to end there
                artist.set_horizontalalignment("right")
                artist.set_x(axes.get_xlim()[1])
                box = self._box(artist)
            if not any(box.overlaps(other) for other in self._placed):
                self._placed.append(box)
                return True
            artist.remove()
        return False


    def _box(self, artist):
        """Where the text is drawn, with a little room on either side (rows of names are
        closer than their boxes are tall: a box's top and bottom are trimmed)."""
        from matplotlib.transforms import Bbox

        box = artist.get_window_extent(self._renderer)
        return Bbox.from_extents(box.x0 - 3, box.y0 + 2, box.x1 + 3, box.y1 - 2)


def _short(span) -> str:
    """``all_reduce (DDP bucket 0), line 6``: the call without its group's ranks, with its mesh
    dimension (``all_gather [tp] (DTensor)``)."""
    label = span.label
    if " rank" in label and " on " in label:
        op, _, rest = label.partition(" on ")
        maker = rest[rest.index("(") :] if "(" in rest else ""
        mesh = f"[{span.mesh_dim}]" if span.mesh_dim else ""
        label = " ".join(part for part in (op, mesh, maker) if part)
    return label + (f", line {span.line}" if span.line is not None else "")


def _listing(profile, ranks: list[int], described: list[str], marks: dict[int, list]) -> str:
    """What the picture shows, without times (deterministic, compared by nbval)."""
    lines = [f"Profile of {rank_label(profile.ranks)}: a lane per rank, compute above, communication below"]
    if len(profile.ranks) > len(ranks):
        lines.append(f"(first {len(ranks)} ranks drawn)")
    first = next((found for found in marks.values() if found), [])
    if first:
        names = list(dict.fromkeys(_mark_name(mark.name) for mark in first))
        shown = ", ".join(names[:6]) + (f", ... ({len(names)} names)" if len(names) > 6 else "")
        lines.append(
            f"  step marks (dashed): {shown}, {len(first)} on rank {next(r for r in marks if marks[r])}"
        )
    counts: dict[str, int] = {}
    for label in described:
        counts[label] = counts.get(label, 0) + 1
    for label, count in counts.items():
        per_rank = count / max(len(ranks), 1)
        times = f" x{per_rank:g} per rank" if per_rank != 1 else ""
        lines.append(f"  communication: {label}{times}")
    return "\n".join(lines)
