"""The error vocabulary: one-line usage errors, per-rank failures, hang and interrupt reports."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from IPython.core.error import UsageError

RESTART_ADVICE = "Run %dist_restart to get working ranks back (same world size and backend)."


def usage_error(message: str) -> UsageError:
    """A user mistake: IPython shows it as one line, without a traceback."""
    return UsageError(message)


def format_ranks(ranks: list[int]) -> str:
    """``[0, 1, 2, 3]`` -> ``0-3``; ``[0, 2]`` -> ``0,2``; runs of three or more become ranges."""
    ordered = sorted(ranks)
    parts: list[str] = []
    start = 0
    while start < len(ordered):
        end = start
        while end + 1 < len(ordered) and ordered[end + 1] == ordered[end] + 1:
            end += 1
        if end - start >= 2:
            parts.append(f"{ordered[start]}-{ordered[end]}")
        else:
            parts.extend(str(rank) for rank in ordered[start : end + 1])
        start = end + 1
    return ",".join(parts)


def rank_label(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {format_ranks(ranks)}"


# ------------------------------------------------------------------ stack dumps
@dataclass(frozen=True)
class Frame:
    filename: str
    line: int
    function: str


_THREAD_HEADER = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+)", re.MULTILINE)
_FRAME = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+) in (?P<func>\S+)', re.MULTILINE)
_DIST_API_FILE = "torch/distributed/distributed_c10d.py"


def parse_stack_dump(dump: str) -> list[list[Frame]]:
    """faulthandler's text -> one frame list per thread, most recent call first."""
    starts = [match.start() for match in _THREAD_HEADER.finditer(dump)] or [0]
    threads = []
    for begin, end in zip(starts, [*starts[1:], len(dump)]):
        frames = [
            Frame(match["file"], int(match["line"]), match["func"])
            for match in _FRAME.finditer(dump[begin:end])
        ]
        if frames:
            threads.append(frames)
    return threads


def cell_frames(threads: list[list[Frame]]) -> list[Frame]:
    """The frames of the thread running the cell, from the cell inwards (most recent last)."""
    for frames in threads:
        for index, frame in enumerate(frames):
            if frame.function == "run_code" and frame.filename.endswith("interactiveshell.py"):
                return list(reversed(frames[:index]))
    return []


@dataclass(frozen=True)
class BlockedRank:
    """Where a rank that did not finish is, read from its stack dump."""

    rank: int
    cell_line: int | None = None
    source_line: str | None = None
    dist_call: str | None = None
    frames: tuple[Frame, ...] = ()
    dump_missing: bool = False
    traced_call: str | None = None  # from the cell's trace: ``recv from rank 1``

    @classmethod
    def from_dump(cls, rank: int, dump: str | None, cell: str, traced_call: str | None = None) -> BlockedRank:
        if not dump:
            return cls(rank=rank, dump_missing=True, traced_call=traced_call)
        frames = cell_frames(parse_stack_dump(dump))
        if not frames:
            return cls(rank=rank, traced_call=traced_call)
        cell_line = frames[0].line
        lines = cell.splitlines()
        source = lines[cell_line - 1].strip() if 0 < cell_line <= len(lines) else None
        dist_calls = [frame.function for frame in frames if frame.filename.endswith(_DIST_API_FILE)]
        return cls(
            rank=rank,
            cell_line=cell_line,
            source_line=source,
            dist_call=dist_calls[0] if dist_calls else None,
            frames=tuple(frames),
            traced_call=traced_call,
        )

    def where(self) -> str:
        """``in all_reduce at cell line 3``, as far as it is known."""
        parts = []
        if self.traced_call:
            parts.append(f"in {self.traced_call}")
        elif self.dist_call:
            parts.append(f"in {self.dist_call}")
        if self.cell_line is not None:
            parts.append(f"at cell line {self.cell_line}")
        return " ".join(parts) or "at an unknown place"

    def report_lines(self) -> list[str]:
        if self.dump_missing:
            return ["    (no stack dump arrived from this rank)"]
        lines = []
        if self.source_line is not None:
            lines.append(f"    line {self.cell_line}: {self.source_line}")
        if self.frames:
            lines.append("    Python stack, most recent call last:")
            cell_file = self.frames[0].filename
            for frame in self.frames:
                where = short_path(frame.filename, cell_file)
                lines.append(f'      File "{where}", line {frame.line}, in {frame.function}')
        return lines


def short_path(filename: str, cell_file: str) -> str:
    """``<cell>`` for the cell's own code, ``torch/distributed/...`` for installed packages:
    the part that says what the code is, without this machine's directories."""
    if filename == cell_file:
        return "<cell>"
    if filename.startswith(_PACKAGE_DIR):  # ddp_magics itself, also when installed editable
        return f"ddp_magics/{filename[len(_PACKAGE_DIR) :]}"
    for marker in ("/site-packages/", "/dist-packages/"):
        if marker in filename:
            return filename.split(marker, 1)[1]
    standard_library = _STANDARD_LIBRARY.search(filename)
    return filename[standard_library.end() :] if standard_library else filename


_STANDARD_LIBRARY = re.compile(r"/lib/python\d+\.\d+/")
_PACKAGE_DIR = str(Path(__file__).resolve().parent) + os.sep


# ------------------------------------------------------------------ cell failures
@dataclass(frozen=True)
class RankFailure:
    rank: int
    ename: str
    evalue: str
    traceback: str


@dataclass(eq=False)
class DistributedCellError(Exception):
    """A %%distributed cell did not finish cleanly on every rank.

    IPython shows ``_render_traceback_`` instead of a Python traceback; the summary
    (the exception's value) is deterministic so nbval can compare it.
    """

    failures: list[RankFailure] = field(default_factory=list)
    blocked: list[BlockedRank] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)
    dead: list[int] = field(default_factory=list)
    timeout: float | None = None
    interrupted: bool = False
    usable: bool = True
    mismatches: list[str] = field(default_factory=list)  # from the cell's trace, in plain words

    def __post_init__(self) -> None:
        super().__init__(self.summary())

    def summary(self) -> str:
        parts = []
        by_error: dict[tuple[str, str], list[int]] = {}
        for failure in self.failures:
            by_error.setdefault((failure.ename, failure.evalue), []).append(failure.rank)
        for (ename, evalue), ranks in by_error.items():
            if ename == "KeyboardInterrupt":
                verb = "was interrupted" if len(ranks) == 1 else "were interrupted"
            else:
                verb = f"raised {ename}"
            parts.append(f"{rank_label(ranks)} {verb}" + (f": {evalue}" if evalue else ""))
        if self.dead:
            parts.append(f"{rank_label(self.dead)} died")
        if self.blocked:
            still = "did not stop" if self.interrupted else "still running"
            after = f" after {self.timeout:g} s" if self.timeout is not None else ""
            places = ", ".join(f"rank {b.rank} {b.where()}" for b in self.blocked)
            parts.append(f"{rank_label([b.rank for b in self.blocked])} {still}{after} ({places})")
        return "; ".join(parts)

    def _render_traceback_(self) -> list[str]:
        lines = [f"{type(self).__name__}: {self.summary()}"]
        # Ranks that failed the same way (an interrupt, the same bad line) share one traceback.
        same_failure: dict[tuple[str, str, str], list[int]] = {}
        for failure in self.failures:
            key = (failure.ename, failure.evalue, failure.traceback)
            same_failure.setdefault(key, []).append(failure.rank)
        for (ename, evalue, traceback_text), ranks in same_failure.items():
            traceback = _without_rule(traceback_text.rstrip().splitlines())
            label = f"[{rank_label(ranks)}]"
            lines.append(label if traceback else f"{label} {ename}: {evalue}")
            lines.extend("    " + line for line in traceback)
        for rank in self.dead:
            lines.append(f"[rank {rank}] its engine process died")
        for blocked in self.blocked:
            lines.append(f"[rank {blocked.rank}] still running, {blocked.where()}")
            lines.extend(blocked.report_lines())
        if self.finished:
            lines.append(f"[{rank_label(self.finished)}] finished")
        lines.extend(f"Mismatch: {message}" for message in self.mismatches)
        if not self.usable:
            lines.append(RESTART_ADVICE)
        return lines


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _without_rule(lines: list[str]) -> list[str]:
    """Drop the ``-----`` line IPython puts above a traceback."""
    if lines and set(_ANSI.sub("", lines[0]).strip()) == {"-"}:
        return lines[1:]
    return lines


def failure_from_remote_error(rank: int, error: BaseException) -> RankFailure:
    """An ipyparallel RemoteError (or any exception) as plain per-rank data."""
    ename = getattr(error, "ename", type(error).__name__)
    evalue = getattr(error, "evalue", str(error))
    traceback = getattr(error, "traceback", "") or ""
    return RankFailure(rank=rank, ename=ename, evalue=evalue, traceback=traceback)
