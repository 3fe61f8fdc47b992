"""faulthandler's stack dumps read as frames: which thread runs the cell, and whether it waits
in communication or is showing the cell's error. Below both the cluster layer (recovery decides
by it) and the reports (:mod:`ddp_magics.stacks`); imports nothing of either side."""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Frame:
    filename: str
    line: int
    function: str


_THREAD_HEADER = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+)", re.MULTILINE)
_FRAME = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+) in (?P<func>\S+)', re.MULTILINE)
DIST_API_FILE = "torch/distributed/distributed_c10d.py"


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
    return communicating(cell_frames(threads))


def communicating(frames: list[Frame] | tuple[Frame, ...]) -> bool:
    return any(
        frame.filename.endswith(DIST_API_FILE) or frame.function == AUTOGRAD_ENGINE_CALL for frame in frames
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


# torch.autograd.graph's call into the C++ engine: below it, backward's hooks (DDP's reducer).
AUTOGRAD_ENGINE_CALL = "_engine_run_backward"
