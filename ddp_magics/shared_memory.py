"""Named shared memory that MPI leaves in /dev/shm when its ranks are killed.

MPICH names the segment its ranks on one machine share ``/mpich_shm_<hex>_<n>`` (libmpi's
``/mpich_shm_%x_%d``) and removes it in ``MPI_Finalize``. Ranks are killed, never finalized (a
rank blocked in a collective ignores SIGTERM), so each MPI job would leave its segment, a
megabyte or more of the machine's memory, until the next boot. Whoever kills a cluster's
processes reads the segments they map first and removes them once they are killed
(:func:`segments_removed_after`). Only names
of that pattern, this user's, and mapped by the processes killed: never a file someone keeps in
/dev/shm on purpose.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path

SHM_DIRECTORY = Path("/dev/shm")
SEGMENT_PREFIX = "mpich_shm_"
# A line of /proc/PID/maps that maps one (a removed file's name ends in " (deleted)").
_MAPPED_SEGMENT = re.compile(rb" (/dev/shm/" + re.escape(SEGMENT_PREFIX.encode()) + rb"[^\s/]+)\n")


@contextlib.contextmanager
def segments_removed_after(pids: Iterable[int]) -> Iterator[None]:
    """Around killing the processes of ``pids``: the MPI segments they map, read before, are
    removed after."""
    segments = mapped_segments(pids)
    try:
        yield
    finally:
        remove_segments(segments)


def mapped_segments(pids: Iterable[int]) -> set[Path]:
    """The MPI segments in /dev/shm that the processes of ``pids`` map (a process that has
    ended maps nothing). Nothing is read while no such segment exists."""
    if not _any_segment():
        return set()
    segments = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps", "rb") as maps:
                text = maps.read()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue  # ended, or another user's PID: nothing of ours mapped
        segments.update(Path(os.fsdecode(path)) for path in _MAPPED_SEGMENT.findall(text))
    return segments


def _any_segment() -> bool:
    try:
        return any(name.startswith(SEGMENT_PREFIX) for name in os.listdir(SHM_DIRECTORY))
    except FileNotFoundError:
        return False  # a machine without /dev/shm: MPI kept its segments elsewhere


def remove_segments(segments: Iterable[Path]) -> None:
    """Remove those of ``segments`` still there that are this user's regular files."""
    for path in segments:
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            continue  # finalized, or removed by another of the job's processes
        if stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
