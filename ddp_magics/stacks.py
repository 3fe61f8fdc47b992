"""Where each rank that did not finish is, as a report shows it (read from its stack dump:
:mod:`ddp_magics.stack_dumps`)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from ddp_magics.stack_dumps import (
    AUTOGRAD_ENGINE_CALL,
    DIST_API_FILE,
    Frame,
    cell_frames,
    communicating,
    parse_stack_dump,
)


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
        dist_calls = [frame.function for frame in frames if frame.filename.endswith(DIST_API_FILE)]
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
        return self.traced_call is not None or communicating(self.frames)

    def where(self) -> str:
        """``in all_reduce at cell line 3``, as far as it is known."""
        parts = []
        if self.traced_call:
            parts.append(f"in {self.traced_call}")
        elif self.dist_call:
            parts.append(f"in {self.dist_call}")
        elif self.frames and self.frames[-1].function == AUTOGRAD_ENGINE_CALL:
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
        if not self.traced_call and self.frames and self.frames[-1].function == AUTOGRAD_ENGINE_CALL:
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


_STANDARD_LIBRARY = re.compile(r"/lib/python\d+\.\d+/")
_PACKAGE_DIR = str(Path(__file__).resolve().parent) + os.sep
