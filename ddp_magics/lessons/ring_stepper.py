"""The ring all-reduce stepper of lesson 04: every step of the algorithm, as an ipywidget."""

from __future__ import annotations

from dataclasses import dataclass
from html import escape as html_escape

from ddp_magics.diagrams import rank_color
from ddp_magics.live_view import WIDGET_MIMETYPE
from ddp_magics.protocol import format_number

REDUCE_SCATTER, ALL_GATHER, START = "reduce-scatter", "all-gather", "start"
RECEIVED_COLORS = {REDUCE_SCATTER: "#e3f2e1", ALL_GATHER: "#e1ecf7"}


@dataclass(frozen=True)
class RingTransfer:
    """One message of a ring step: ``src`` sends its chunk ``chunk`` to ``dst``."""

    src: int
    dst: int
    chunk: int


@dataclass(frozen=True)
class RingState:
    """The ranks' buffers after one step of the bandwidth-optimal ring all-reduce.

    ``values[r][c]`` is chunk ``c`` of rank ``r``'s buffer and ``sources[r][c]`` the ranks whose
    inputs are summed in it; ``transfers`` are the messages of the step that led here.
    """

    phase: str
    number: int  # 1, 2, ... within the phase; 0 for the start
    transfers: tuple[RingTransfer, ...]
    values: tuple[tuple[tuple[float, ...], ...], ...]
    sources: tuple[tuple[frozenset[int], ...], ...]

    def title(self, world_size: int) -> str:
        if self.phase == START:
            return f"start: each of the {world_size} ranks holds its own input, cut into {world_size} chunks"
        action = "adds it to its own" if self.phase == REDUCE_SCATTER else "keeps it (a finished sum)"
        return (
            f"{self.phase} step {self.number} of {world_size - 1}: every rank sends one chunk to its right "
            f"neighbour, which {action}"
        )


def ring_allreduce_states(inputs: list[list[float]]) -> list[RingState]:
    """Every state of the ring all-reduce (reduce-scatter, then all-gather) of ``inputs``, one per rank.

    Chunks are cut like ``tensor.tensor_split(world_size)``. At reduce-scatter step ``s`` (from 0) rank
    ``r`` sends chunk ``(r - s) % n`` to rank ``r + 1``, which adds it to its own; after ``n - 1`` steps
    rank ``r`` holds the full sum of chunk ``(r + 1) % n``. At all-gather step ``s`` rank ``r`` sends
    chunk ``(r + 1 - s) % n``, and the receiver overwrites its copy.
    """
    world_size = len(inputs)
    if world_size < 2:
        raise ValueError(f"a ring needs at least 2 ranks, got {world_size}")
    lengths = {len(values) for values in inputs}
    if len(lengths) != 1:
        raise ValueError(f"every rank needs an input of the same length, got lengths {sorted(lengths)}")
    length = lengths.pop()
    if length < world_size:
        raise ValueError(f"{length} elements cannot be cut into {world_size} non-empty chunks")
    bounds = _chunk_bounds(length, world_size)
    values = [[tuple(float(v) for v in rank_values[a:b]) for a, b in bounds] for rank_values in inputs]
    sources = [[frozenset({rank})] * world_size for rank in range(world_size)]
    states = [_ring_state(START, 0, (), values, sources)]
    for phase in (REDUCE_SCATTER, ALL_GATHER):
        for step in range(world_size - 1):
            offset = -step if phase == REDUCE_SCATTER else 1 - step
            transfers = tuple(
                RingTransfer(rank, (rank + 1) % world_size, (rank + offset) % world_size)
                for rank in range(world_size)
            )
            sent = [(t, values[t.src][t.chunk], sources[t.src][t.chunk]) for t in transfers]
            for transfer, chunk_values, chunk_sources in sent:
                dst, chunk = transfer.dst, transfer.chunk
                if phase == REDUCE_SCATTER:
                    values[dst][chunk] = tuple(a + b for a, b in zip(values[dst][chunk], chunk_values))
                    sources[dst][chunk] = sources[dst][chunk] | chunk_sources
                else:
                    values[dst][chunk], sources[dst][chunk] = chunk_values, chunk_sources
            states.append(_ring_state(phase, step + 1, transfers, values, sources))
    return states


def _chunk_bounds(length: int, parts: int) -> list[tuple[int, int]]:
    """Start and end of each part, as ``tensor_split`` cuts: the first ``length % parts`` are one longer."""
    base, extra = divmod(length, parts)
    bounds, start = [], 0
    for part in range(parts):
        end = start + base + (part < extra)
        bounds.append((start, end))
        start = end
    return bounds


def _ring_state(phase, number, transfers, values, sources) -> RingState:
    return RingState(phase, number, transfers, tuple(map(tuple, values)), tuple(map(tuple, sources)))


class RingStepper:
    """Walk the steps of a ring all-reduce: each rank's chunks, and what moved at each step.

    In JupyterLab it shows as a widget (play, slider, previous/next) while its kernel runs; a saved
    notebook reopened without re-running the cell shows "model not found" there, like any widget.
    Frontends without widgets, nbconvert and nbval see the text of its current step.
    ``text(step)`` and ``html(step)`` render any step.
    """

    def __init__(self, inputs: list[list[float]], interval_ms: int = 1500) -> None:
        self.states = ring_allreduce_states(inputs)
        self.world_size = len(inputs)
        self.interval_ms = interval_ms
        self.step = 0
        self._widget = None
        self._slider = None

    @property
    def result(self) -> list[list[float]]:
        """Each rank's buffer after the last step."""
        return [[v for chunk in rank_chunks for v in chunk] for rank_chunks in self.states[-1].values]

    def text(self, step: int | None = None) -> str:
        number = self.step if step is None else step
        state = self.states[number]
        chunk_names = [f"chunk {c}" for c in range(self.world_size)]
        rows = [["", *chunk_names]]
        for rank in range(self.world_size):
            rows.append(
                [f"rank {rank}"] + [self._cell_text(state, rank, chunk) for chunk in range(self.world_size)]
            )
        widths = [max(len(row[col]) for row in rows) for col in range(len(rows[0]))]
        lines = [f"step {number} of {len(self.states) - 1}, {state.title(self.world_size)}"]
        lines += [f"  rank {t.src} -> rank {t.dst}: chunk {t.chunk}" for t in state.transfers]
        lines += [
            "  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows
        ]
        if state.transfers:
            lines.append("  (* = the chunk this rank received at this step)")
        return "\n".join(lines)

    def _cell_text(self, state: RingState, rank: int, chunk: int) -> str:
        values = ", ".join(format_number(v) for v in state.values[rank][chunk])
        received = any(t.dst == rank and t.chunk == chunk for t in state.transfers)
        return f"[{values}] {_sources_text(state.sources[rank][chunk], self.world_size)}" + (
            " *" if received else ""
        )

    def html(self, step: int | None = None) -> str:
        number = self.step if step is None else step
        state = self.states[number]
        moved = "".join(
            f"<li><span style='color:{rank_color(t.src)}'>rank {t.src}</span> &rarr; "
            f"<span style='color:{rank_color(t.dst)}'>rank {t.dst}</span>: chunk {t.chunk}</li>"
            for t in state.transfers
        )
        header = "".join(f"<th style='padding:2px 10px'>chunk {c}</th>" for c in range(self.world_size))
        rows = "".join(
            f"<tr><th style='padding:2px 10px;color:{rank_color(rank)}'>rank {rank}</th>"
            + "".join(self._cell_html(state, rank, chunk) for chunk in range(self.world_size))
            + "</tr>"
            for rank in range(self.world_size)
        )
        title = html_escape(state.title(self.world_size))
        return (
            f"<div><b>step {number} of {len(self.states) - 1}</b>, {title}"
            f"<ul style='margin:2px 0'>{moved}</ul>"
            f"<table style='border-collapse:collapse;font-family:monospace'>"
            f"<tr><th></th>{header}</tr>{rows}</table>"
            "<small>shaded: the chunk a rank just received (green: added, blue: copied); "
            "bold: a chunk that already holds every rank's input</small></div>"
        )

    def _cell_html(self, state: RingState, rank: int, chunk: int) -> str:
        values = ", ".join(format_number(v) for v in state.values[rank][chunk])
        sources = state.sources[rank][chunk]
        received = any(t.dst == rank and t.chunk == chunk for t in state.transfers)
        background = RECEIVED_COLORS[state.phase] if received else "transparent"
        weight = "bold" if len(sources) == self.world_size else "normal"
        return (
            f"<td style='border:1px solid #bbb;padding:2px 10px;"
            f"background:{background};font-weight:{weight}'>"
            f"[{values}]<br><small>{_sources_text(sources, self.world_size)}</small></td>"
        )

    def widget(self):
        """The ipywidgets view (built once): play, slider, previous/next and the current step.

        Every step is rendered up front into a ``Stack`` that the slider selects in the browser
        (``jslink``), so play and the slider keep working while the kernel is busy; previous/next
        are kernel callbacks.
        """
        if self._widget is None:
            import ipywidgets

            last = len(self.states) - 1
            pages = ipywidgets.Stack(
                [ipywidgets.HTML(value=self.html(step)) for step in range(last + 1)], selected_index=self.step
            )
            slider = ipywidgets.IntSlider(value=self.step, min=0, max=last, description="step")
            play = ipywidgets.Play(value=self.step, min=0, max=last, interval=self.interval_ms)
            ipywidgets.jslink((play, "value"), (slider, "value"))
            ipywidgets.jslink((slider, "value"), (pages, "selected_index"))
            previous = ipywidgets.Button(description="previous", icon="step-backward")
            following = ipywidgets.Button(description="next", icon="step-forward")

            def show(change) -> None:
                self.step = change["new"]
                pages.selected_index = self.step  # the browser already did; this keeps the kernel's copy

            slider.observe(show, names="value")
            previous.on_click(lambda _: setattr(slider, "value", max(0, slider.value - 1)))
            following.on_click(lambda _: setattr(slider, "value", min(last, slider.value + 1)))
            self._widget = ipywidgets.VBox([ipywidgets.HBox([play, previous, following, slider]), pages])
            self._slider = slider
        return self._widget

    def show(self, step: int) -> None:
        """Move to ``step`` (the widget follows)."""
        if not 0 <= step < len(self.states):
            raise ValueError(f"step {step}: this ring has steps 0 to {len(self.states) - 1}")
        self.step = step
        if self._widget is not None:
            self._slider.value = step

    def _repr_mimebundle_(self, include=None, exclude=None) -> dict:
        return {
            WIDGET_MIMETYPE: {"model_id": self.widget().model_id, "version_major": 2, "version_minor": 0},
            "text/plain": self.text(),
        }


def _sources_text(sources: frozenset[int], world_size: int) -> str:
    if len(sources) == world_size:
        return "(all ranks)"
    return "(" + "+".join(f"r{rank}" for rank in sorted(sources)) + ")"


def draw_ring_steps(inputs: list[list[float]]):
    """Every step of the ring all-reduce of ``inputs`` as one static matplotlib figure, one panel per step.

    A panel is a grid, a row per rank and a column per chunk; a square's shade is how many ranks' inputs its
    chunk holds (white: one, dark: all), its number the chunk's first value, and a thick frame marks the chunk
    that arrived at that step (green in the reduce-scatter, blue in the all-gather), with an arrow from the
    sender's square to it (the last rank's arrow to rank 0 curves back up the panel). Deterministic: the same
    inputs draw the same picture.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    states = ring_allreduce_states(inputs)
    n = len(inputs)
    frames = {REDUCE_SCATTER: "#2e7d32", ALL_GATHER: "#1565c0"}
    figure, axes = plt.subplots(1, len(states), figsize=(1.45 * len(states) + 0.4, 0.42 * n + 1.1))
    for ax, state in zip(axes, states):
        arrived = {(t.dst, t.chunk): t.src for t in state.transfers}
        for rank in range(n):
            for chunk in range(n):
                share = len(state.sources[rank][chunk])
                shade = 1.0 - 0.75 * (share - 1) / (n - 1)
                ax.add_patch(Rectangle((chunk, rank), 1, 1, facecolor=(shade, shade, shade), edgecolor="0.6"))
                value = state.values[rank][chunk][0]
                ax.text(chunk + 0.5, rank + 0.5, format_number(value), ha="center", va="center", fontsize=7,
                        color="white" if shade < 0.5 else "black")
                if (rank, chunk) in arrived:
                    ax.add_patch(Rectangle((chunk + 0.05, rank + 0.05), 0.9, 0.9, fill=False, linewidth=2.2,
                                           edgecolor=frames[state.phase]))
                    src = arrived[rank, chunk]
                    bend = 0.25 if abs(rank - src) == 1 else -0.5  # around the ring: the wrap curves back up
                    ax.annotate("", xy=(chunk + 0.88, rank + 0.3), xytext=(chunk + 0.88, src + 0.7),
                                arrowprops=dict(arrowstyle="-|>", color=frames[state.phase], linewidth=1.1,
                                                mutation_scale=7, connectionstyle=f"arc3,rad={bend}"))
        ax.set_xlim(0, n)
        ax.set_ylim(n, 0)
        ax.set_aspect("equal")
        ax.set_xticks([c + 0.5 for c in range(n)], [f"c{c}" for c in range(n)], fontsize=7)
        ax.set_yticks([r + 0.5 for r in range(n)], [f"r{r}" for r in range(n)], fontsize=7)
        ax.tick_params(length=0)
        short = "RS" if state.phase == REDUCE_SCATTER else "AG"
        name = "start" if state.phase == START else f"{short} {state.number}"
        ax.set_title(name, fontsize=9, color=frames.get(state.phase, "black"))
    figure.suptitle(
        "ring all-reduce, step by step: rows are ranks, columns chunks; darker = more ranks' inputs summed\n"
        "framed = arrived this step, arrow from its sender (RS: reduce-scatter, adds; AG: all-gather, keeps)",
        fontsize=8,
    )
    figure.tight_layout()
    return figure
