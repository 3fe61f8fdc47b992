"""Rank-ordered rendering of what each rank printed, displayed and returned.

The text form (what nbval compares) is one block per rank headed ``[rank N]``; ranks whose
whole output is identical share one block headed ``[ranks 0-3]`` or ``[ranks 0,2]``.
"""

from __future__ import annotations

import html
from dataclasses import dataclass

from ddp_magics.cluster.records import RankOutput
from ddp_magics.protocol import format_ranks, rank_label

# Characters of a rank's stdout (and of its stderr) shown at most, whatever its number of lines.
MAX_SHOWN_CHARS = 100_000


def tail(
    text: str, max_lines: int | None, max_chars: int = MAX_SHOWN_CHARS, count_dropped: bool = True
) -> str:
    """The last ``max_lines`` lines of ``text`` (all of them with None), and of those at most the
    last ``max_chars`` characters, with a note of what was dropped. Only the kept end of ``text``
    is read, and with ``count_dropped`` the dropped part once more to count it (the live view,
    which asks again every half second while the output grows, does not count)."""
    start = window_start = max(0, len(text) - max_chars)
    if max_lines is not None:
        position = len(text) - 1 if text.endswith("\n") else len(text)
        for _ in range(max_lines):
            newline = text.rfind("\n", window_start, position)
            if newline < 0:
                break
            position = newline
        else:
            start = position + 1
    if start == 0:
        return text
    if not count_dropped:
        note = "... earlier output not shown ..."
    elif start > window_start or text[start - 1] == "\n":
        note = f"... {text.count(chr(10), 0, start)} earlier lines not shown ..."
    else:
        note = f"... {start:,} earlier characters not shown ..."
    return f"{note}\n{text[start:]}"


@dataclass(frozen=True)
class RankBlock:
    ranks: list[int]
    stdout: str
    stderr: str
    result_text: str

    @property
    def header(self) -> str:
        return f"[{rank_label(self.ranks)}]"

    def text(self) -> str:
        body = "".join(
            part if part.endswith("\n") else part + "\n"
            for part in (self.stdout, self.stderr, self.result_text)
            if part
        )
        return f"{self.header}\n{body}"


class RankBlocks:
    """Blocks of rank output; text for nbval and terminals, columns in JupyterLab."""

    def __init__(self, blocks: list[RankBlock]) -> None:
        self.blocks = blocks

    def __repr__(self) -> str:
        return "".join(block.text() for block in self.blocks).rstrip("\n")

    def _repr_pretty_(self, printer, cycle: bool) -> None:
        printer.text(repr(self))

    def _repr_html_(self) -> str:
        columns = []
        for block in self.blocks:
            parts = [f'<div class="ddp-rank-header"><b>{html.escape(block.header)}</b></div>']
            if block.stdout:
                parts.append(html_pre(block.stdout))
            if block.stderr:
                parts.append(html_pre(block.stderr, "background:#fdd"))
            if block.result_text:
                parts.append(html_pre(block.result_text))
            columns.append("".join(parts))
        return html_columns(columns, [block.text() for block in self.blocks])


# Lines are never broken inside a word (JupyterLab's own <pre> style breaks anywhere). The
# columns are a grid of equal widths, as many to a row as fit, so that they line up from row to
# row at any number of ranks; a column is as wide as the longest line shown (within limits), and
# a longer line scrolls inside its column.
_PRE_STYLE = "white-space:pre;word-break:normal;overflow-wrap:normal;margin:0.2em 0"
_COLUMN_STYLE = "min-width:0;overflow-x:auto"
MIN_COLUMN_CHARACTERS, MAX_COLUMN_CHARACTERS = 14, 80
# In the code font, so that a ch is a character of the <pre> inside.
_GRID_STYLE = (
    "gap:0.5em 1.5em;font-family:var(--jp-code-font-family,monospace);font-size:var(--jp-code-font-size,13px)"
)


def html_pre(text: str, style: str = "") -> str:
    return f'<pre style="{_PRE_STYLE};{style}">{html.escape(text)}</pre>'


def html_columns(columns: list[str], texts: list[str] = ()) -> str:
    """HTML fragments side by side, one column each, in a grid of equal columns sized to the
    longest line of ``texts`` (the plain text they show)."""
    longest = max((len(line) for text in texts for line in text.splitlines()), default=0)
    width = min(max(longest + 1, MIN_COLUMN_CHARACTERS), MAX_COLUMN_CHARACTERS)
    cells = "".join(f'<div style="{_COLUMN_STYLE}">{column}</div>' for column in columns)
    grid = (
        f"display:grid;grid-template-columns:repeat(auto-fill,minmax(min({width}ch,100%),1fr));{_GRID_STYLE}"
    )
    return f'<div class="ddp-rank-grid" style="{grid}">{cells}</div>'


def live_html(outputs: list[RankOutput], pending: set[int], elapsed: float, tail_lines: int) -> str:
    """What a cell still running shows: how long it has run, and each rank's latest output."""
    columns, texts = [], []
    for output in outputs:
        state = "running" if output.rank in pending else "finished"
        text = tail(as_terminal(output.stdout), tail_lines, count_dropped=False) + tail(
            as_terminal(output.stderr), tail_lines, count_dropped=False
        )
        columns.append(f"<b>[rank {output.rank}]</b> {state}{html_pre(text)}")
        texts.append(f"[rank {output.rank}] {state}\n{text}")
    ranks = [output.rank for output in outputs]
    finished = [rank for rank in ranks if rank not in pending]
    header = (
        f"running for {elapsed:.0f} s; finished: {format_ranks(finished) or 'none'}; "
        f"running: {format_ranks(sorted(pending)) or 'none'}"
    )
    return f"<div>{header}</div>{html_columns(columns, texts)}"


def as_terminal(text: str) -> str:
    """Each line as a terminal would leave it: what follows its last carriage return (a progress
    bar's latest frame, where a browser's <pre> would show every frame on a line of its own)."""
    if "\r" not in text:
        return text
    lines = []
    for line in text.split("\n"):
        frames = [frame for frame in line.split("\r") if frame]
        lines.append(frames[-1] if frames else "")
    return "\n".join(lines)


def group_outputs(outputs: list[RankOutput], collapse: bool) -> list[tuple[list[int], RankOutput]]:
    """Ranks with output, in rank order; identical outputs share a group when ``collapse``."""
    groups: dict[object, tuple[list[int], RankOutput]] = {}
    for output in sorted(outputs, key=lambda output: output.rank):
        if output.is_empty():
            continue
        key = output.signature() if collapse else output.rank
        groups.setdefault(key, ([], output))[0].append(output.rank)
    return list(groups.values())


def render(outputs: list[RankOutput], collapse: bool = True, max_lines: int = 200) -> list:
    """Objects to display, in order: rank blocks, each followed by that rank's rich displays.

    Rich displays come back as raw mimebundles ``{"data": ..., "metadata": ...}``.
    """
    groups = group_outputs(outputs, collapse)

    def block(ranks: list[int], output: RankOutput) -> RankBlock:
        return RankBlock(
            ranks=ranks,
            stdout=tail(output.stdout, max_lines),
            stderr=tail(output.stderr, max_lines),
            # A value's text is not cut to lines, only when huge: a model's repr can be long.
            result_text=tail(output.result_text, max_lines=None),
        )

    if not any(output.rich_displays for _, output in groups):
        return [RankBlocks([block(ranks, output) for ranks, output in groups])] if groups else []
    rendered: list = []
    for ranks, output in groups:
        rendered.append(RankBlocks([block(ranks, output)]))
        rendered.extend(output.rich_displays)
    return rendered


class StatusTable:
    """%dist_status: one row per rank."""

    def __init__(self, backend: str, statuses: list, busy: list[int], memory: dict | None = None) -> None:
        self.backend = backend
        # {rank: RankMemory or None}: shown after the columns (``rows`` keeps the columns above).
        self.memory = memory or {}
        # Ranks on several hosts: which address each host has (namespaces of one machine, or
        # machines, may share a host name).
        several_hosts = len({status.info.address for status in statuses}) > 1
        self.columns = ("rank", "host", *(["address"] if several_hosts else []), "pid", "device", "state")
        self.rows = [
            (
                str(status.info.rank),
                status.info.host,
                *([status.info.address] if several_hosts else []),
                str(status.info.pid),
                status.info.device,
                "dead" if not status.alive else "busy" if status.info.rank in busy else "alive",
            )
            for status in statuses
        ]

    def _shown(self) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
        """The columns and rows with each rank's memory: unique and proportional where known
        (else resident), GPU memory where a rank has any."""
        if not self.memory:
            return self.columns, self.rows
        known = [m for m in self.memory.values() if m is not None]
        pages = any(m.unique is not None for m in known)
        gpu = any(m.cuda_reserved is not None for m in known)
        columns = (
            *self.columns,
            *(["unique", "pss"] if pages else ["resident"]),
            *(["cuda allocated", "cuda reserved"] if gpu else []),
        )
        rows = []
        for row in self.rows:
            found = self.memory.get(int(row[0]))
            if pages:
                cells = [
                    _bytes(found.unique if found else None),
                    _bytes(found.proportional if found else None),
                ]
            else:
                cells = [_bytes(found.resident if found else None)]
            if gpu:
                cells += [
                    _bytes(found.cuda_allocated if found else None),
                    _bytes(found.cuda_reserved if found else None),
                ]
            rows.append((*row, *cells))
        return columns, rows

    def notes(self) -> list[str]:
        """What the memory columns mean, and the ranks' memory together."""
        known = [m for m in self.memory.values() if m is not None]
        if not any(m.unique is not None for m in known):
            return (
                ["resident: the process's resident memory (pages shared with other ranks counted in each)"]
                if known
                else []
            )
        together = sum(m.proportional or 0 for m in known)
        return [
            "unique: memory only this rank's process uses (freed if it ended); pss: unique plus its",
            "share of the pages it shares with the other ranks (forked from one process): the ranks'",
            f"pss add up to what they take together ({_bytes(together)} here)",
        ]

    def __repr__(self) -> str:
        columns, rows = self._shown()
        widths = [max(len(row[i]) for row in [columns, *rows]) for i in range(len(columns))]
        lines = [f"backend {self.backend}, world size {len(self.rows)}"]
        for row in [columns, *rows]:
            lines.append("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
        return "\n".join([*lines, *self.notes()])

    def _repr_pretty_(self, printer, cycle: bool) -> None:
        printer.text(repr(self))

    def _repr_html_(self) -> str:
        columns, rows = self._shown()
        head = "".join(f"<th>{column}</th>" for column in columns)
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(cell)}</td>" for cell in row) + "</tr>" for row in rows
        )
        notes = f"<p><small>{html.escape(' '.join(self.notes()))}</small></p>" if self.notes() else ""
        return (
            f"<p>backend {html.escape(self.backend)}, world size {len(self.rows)}</p>"
            f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>{notes}"
        )


def _bytes(count: int | None) -> str:
    """``1.2 GiB``, ``350.0 MiB``; ``?`` when unknown."""
    if count is None:
        return "?"
    if count >= 1 << 30:
        return f"{count / (1 << 30):.1f} GiB"
    return f"{count / (1 << 20):.1f} MiB"
