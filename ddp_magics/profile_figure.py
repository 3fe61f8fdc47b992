"""The picture of a :class:`~ddp_magics.profile.Profile`: one lane per rank on the shared clock,
compute above (grey) and communication below (orange, each call named as ``--trace`` names it),
the time each rank spent in ``c10d::`` calls as thin dark marks. A loop's hundreds of ranges stay
readable: ranges are drawn as bars, and each call's name is written once per lane, under its
first bar, where no other name is."""

from __future__ import annotations

from ddp_magics.figures import Diagram, rank_color
from ddp_magics.protocol import COMMUNICATION, COMPUTE, LAUNCH, rank_label

COMPUTE_COLOR, COMMUNICATION_COLOR, LAUNCH_COLOR = "#9e9e9e", "#ef6c00", "#37474f"
LANE_HEIGHT = 1.3
LABEL_ROWS = 3  # under each lane
MAX_LANES = 16
CHARACTER_FRACTION = 0.0065  # of the drawn time: the width of a character of a name


def draw_profile(profile, max_spans: int = 4000) -> Diagram:
    from matplotlib.figure import Figure

    ranks = profile.ranks[:MAX_LANES]
    end = max((span.end for rank in ranks for span in profile.spans[rank]), default=0.0) or 1e-3
    height = 0.9 + 1.2 * len(ranks)
    figure = Figure(figsize=(11, height))
    axes = figure.add_axes((0.1, 0.8 / height, 0.88, 1 - 1.1 / height))
    described = []
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
        named, free_from = set(), [0.0] * LABEL_ROWS
        for index, span in enumerate(spans):
            if span.kind != COMMUNICATION or not span.label:
                continue
            described.append(_short(span))
            row = next((row for row in range(LABEL_ROWS) if free_from[row] <= span.start), None)
            if span.label in named or row is None:
                continue
            named.add(span.label)
            free_from[row] = span.start + len(_short(span)) * CHARACTER_FRACTION * end
            axes.text(
                span.start * 1e3,
                y - 0.45 - 0.17 * row,
                _short(span),
                fontsize=7,
                va="top",
                ha="left",
                clip_on=True,
                gid=f"label:{rank}:{index}",
            )
    axes.set_yticks([-lane * LANE_HEIGHT for lane in range(len(ranks))])
    axes.set_yticklabels([f"rank {rank}" for rank in ranks])
    for label, rank in zip(axes.get_yticklabels(), ranks):
        label.set_color(rank_color(rank))
    axes.set_ylim(-(len(ranks) - 1) * LANE_HEIGHT - 1.0, 0.6)
    axes.set_xlim(0, end * 1e3 * 1.01)
    axes.set_xlabel("ms since the profile started (one clock for every rank)")
    axes.set_title("compute (grey, above) and communication (orange, below) per rank", fontsize=10)
    for side in ("top", "right"):
        axes.spines[side].set_visible(False)
    return Diagram(figure, _listing(profile, ranks, described))


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


def _listing(profile, ranks: list[int], described: list[str]) -> str:
    """What the picture shows, without times (deterministic, compared by nbval)."""
    lines = [f"Profile of {rank_label(profile.ranks)}: a lane per rank, compute above, communication below"]
    if len(profile.ranks) > len(ranks):
        lines.append(f"(first {len(ranks)} ranks drawn)")
    counts: dict[str, int] = {}
    for label in described:
        counts[label] = counts.get(label, 0) + 1
    for label, count in counts.items():
        per_rank = count / max(len(ranks), 1)
        times = f" x{per_rank:g} per rank" if per_rank != 1 else ""
        lines.append(f"  communication: {label}{times}")
    return "\n".join(lines)
