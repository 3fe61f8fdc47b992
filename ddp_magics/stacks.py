"""Reading faulthandler's stack dumps: where each rank that did not finish is."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path


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


def in_a_collective(threads: list[list[Frame]]) -> bool:
    """Whether the thread running the cell is in a torch.distributed call, or in backward (where
    DDP's reducer waits for its all-reduces)."""
    return _communicating(cell_frames(threads))


def _communicating(frames: list[Frame] | tuple[Frame, ...]) -> bool:
    return any(
        frame.filename.endswith(_DIST_API_FILE) or frame.function == _AUTOGRAD_ENGINE_CALL for frame in frames
    )


def formatting_an_error(threads: list[list[Frame]]) -> bool:
    """Whether the thread running the cell is in IPython showing the cell's error (the cell has
    raised and is about to end), not in the cell's code."""
    for frames in threads:
        for index, frame in enumerate(frames):
            if frame.function == "run_code" and frame.filename.endswith("interactiveshell.py"):
                return any(
                    inner.filename.endswith("ultratb.py") or "/stack_data/" in inner.filename
                    for inner in frames[:index]
                )
    return False


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

    @property
    def in_communication(self) -> bool:
        """Whether it waits in a torch.distributed call (or in backward, where DDP's reducer
        waits for its all-reduces), as far as its stack or its trace tell."""
        return self.traced_call is not None or _communicating(self.frames)

    def where(self) -> str:
        """``in all_reduce at cell line 3``, as far as it is known."""
        parts = []
        if self.traced_call:
            parts.append(f"in {self.traced_call}")
        elif self.dist_call:
            parts.append(f"in {self.dist_call}")
        elif self.frames and self.frames[-1].function == _AUTOGRAD_ENGINE_CALL:
            parts.append("in backward")
        if self.cell_line is not None:
            parts.append(f"at cell line {self.cell_line}")
        return " ".join(parts) or "at an unknown place"

    def report_lines(self) -> list[str]:
        if self.dump_missing:
            return ["    (no stack dump arrived from this rank)"]
        lines = []
        if self.source_line is not None:
            lines.append(f"    line {self.cell_line}: {self.source_line}")
        if not self.traced_call and self.frames and self.frames[-1].function == _AUTOGRAD_ENGINE_CALL:
            lines.append(
                "    (in backward's C++ code, where DDP's reducer all-reduces gradients: "
                "%%distributed --trace names the call it waits in)"
            )
        if self.frames:
            lines.append("    Python stack, most recent call last:")
            cell_file = self.frames[0].filename
            for frame in self.frames:
                where = short_path(frame.filename, cell_file)
                # Line numbers of the cell only: those of installed code change with its version.
                line = f", line {frame.line}" if frame.filename == cell_file else ""
                lines.append(f'      File "{where}"{line}, in {frame.function}')
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


# torch.autograd.graph's call into the C++ engine: below it, backward's hooks (DDP's reducer).
_AUTOGRAD_ENGINE_CALL = "_engine_run_backward"
_STANDARD_LIBRARY = re.compile(r"/lib/python\d+\.\d+/")
_PACKAGE_DIR = str(Path(__file__).resolve().parent) + os.sep
