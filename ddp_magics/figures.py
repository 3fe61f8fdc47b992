"""What every picture of communication is made of: a :class:`Diagram` (a matplotlib figure and
the text that describes it) and the pieces drawn on its figure (boxes, arrows, titles), in each
rank's own colour.

Each :class:`Diagram` shows as an image in a notebook and has a deterministic text form (the
listing of ops and values) that nbval compares. Artists carry gids (``before:0``,
``arrow:0->1``, ``event:1:3``, ...) so tests can check what was drawn. matplotlib (half a second
to import) is imported when a figure is first made, not with this module.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# Inches per data unit: the axes fill the figure, so text (in points) and boxes (in data units)
# keep their proportions whatever the number of ranks.
INCHES_PER_X, INCHES_PER_Y = 0.95, 0.75
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


def new_figure() -> tuple[Figure, object]:
    from matplotlib.figure import Figure

    figure = Figure()
    axes = figure.add_axes((0, 0, 1, 1))
    axes.set_axis_off()
    return figure, axes


def fit_figure(figure: Figure, axes, xlim: tuple[float, float], ylim: tuple[float, float]) -> None:
    """Show ``xlim`` x ``ylim`` at a fixed scale; text outside it widens the saved image."""
    axes.set_xlim(*xlim)
    axes.set_ylim(*ylim)
    figure.set_size_inches((xlim[1] - xlim[0]) * INCHES_PER_X, (ylim[1] - ylim[0]) * INCHES_PER_Y)


def draw_title(axes, x: float, y: float, text: str) -> None:
    axes.text(x, y, text, ha="center", va="center", fontsize=11, gid="title")


def draw_box(axes, x, y, width, height, text, edge, gid, dashed=False, fontsize=8.5) -> None:
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


def draw_arrow(axes, start, end, rank: int, gid: str, size: float, width: float, zorder=None) -> None:
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
