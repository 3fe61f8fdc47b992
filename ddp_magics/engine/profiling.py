"""``torch.profiler`` on a rank for one cell (the engine side of ``--profile``).

``start_profile`` enters a profiler just before the next cell (CPU, and CUDA where the rank has a
GPU); as the cell ends (IPython's ``post_execute``, also when it raised) the profiler stops and
what it recorded is reduced to a :class:`~ddp_magics.protocol.RankProfile` published to the
notebook (``PROFILE_KEY``): each thread's top-level ranges, every ``c10d::`` call (also those
DDP's reducer makes inside backward) and every range of the backend moving data (``gloo:*`` on
gloo's threads, NCCL's kernels on the GPU), on the rank's clock (the profiler's start is seconds
since the epoch, ``kineto_results.trace_start_ns``). The notebook merges the ranks' profiles.

The profiler's C++ side (kineto) writes lines with PIDs and times to file descriptor 2: they are
kept out of the cell's output (the rank's stderr is sent to /dev/null while the profiler starts
and stops).
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager

from ddp_magics.protocol import COMMUNICATION, COMPUTE, LAUNCH, PROFILE_KEY, ProfiledSlice, RankProfile

MAX_SLICES = 200_000  # per rank and cell
TOP_OPS = 8
BACKEND_PREFIXES = ("gloo:", "nccl:", "mpi:", "ucc:")
USER_SCOPE = 7  # torch's RecordScope::USER_SCOPE


class CellProfiler:
    """One cell's profiler on this rank."""

    def __init__(self) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        self.rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        self.activities = tuple(activity.name.lower() for activity in activities)
        self._profile = profile(activities=activities)
        self.active = False

    def start(self) -> None:
        with _quiet_fd2():
            self._profile.__enter__()
        self.active = True

    def stop(self) -> RankProfile:
        self.active = False
        try:
            with _quiet_fd2():
                self._profile.__exit__(None, None, None)
            return self._reduce()
        except Exception as error:  # a profile that cannot be read must not fail the cell
            return RankProfile(
                self.rank, (), (), 0.0, 0.0, self.activities, error=f"{type(error).__name__}: {error}"
            )

    def _reduce(self) -> RankProfile:
        results = self._profile.profiler.kineto_results
        origin = results.trace_start_ns() / 1e9
        slices = []
        left_out = 0
        last = origin
        for event in self._profile.events():
            kind = _kind(event)
            if kind is None:
                continue
            start = origin + event.time_range.start / 1e6
            end = origin + event.time_range.end / 1e6
            last = max(last, end)
            if len(slices) >= MAX_SLICES:
                left_out += 1
                continue
            device = "cuda" if event.device_type.name == "CUDA" else "cpu"
            thread = event.device_index * 1000 + event.thread if device == "cuda" else event.thread
            slices.append(ProfiledSlice(event.name, start, end, thread, kind, device))
        averages = sorted(
            (
                (average.key, average.count, average.self_cpu_time_total / 1e6)
                for average in self._profile.key_averages()
                if not average.key.startswith(("c10d::", *BACKEND_PREFIXES))
            ),
            key=lambda op: -op[2],
        )
        return RankProfile(
            self.rank, tuple(slices), tuple(averages[:TOP_OPS]), origin, last, self.activities, left_out
        )


def _kind(event) -> str | None:
    """What an event of the profile was, or None for one inside another op of its thread."""
    name = event.name
    if event.device_type.name == "CUDA":
        return COMMUNICATION if "nccl" in name.lower() else COMPUTE
    if name.startswith(BACKEND_PREFIXES):
        return COMMUNICATION
    if name.startswith("c10d::"):
        return LAUNCH
    if event.scope == USER_SCOPE:  # record_function: DistributedDataParallel.forward, Optimizer.step
        return None  # it may wait for communication; what it runs counts
    parent = event.cpu_parent
    while parent is not None and parent.scope == USER_SCOPE:
        parent = parent.cpu_parent
    return COMPUTE if parent is None else None


@contextmanager
def _quiet_fd2():
    """File descriptor 2 sent to /dev/null (kineto's start and stop lines); sys.stderr is
    flushed first so nothing of the cell's is lost."""
    sys.stderr.flush()
    saved = os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


_profiler: CellProfiler | None = None


def start_profile() -> None:
    """Profile the next cell this engine executes (sent just before that cell)."""
    global _profiler
    from IPython import get_ipython

    if _profiler is not None and _profiler.active:
        _stop_profile()
    _profiler = CellProfiler()
    _profiler.start()
    get_ipython().events.register("post_execute", _stop_profile)


def _stop_profile() -> None:
    from IPython import get_ipython

    events = get_ipython().events
    if _stop_profile in events.callbacks["post_execute"]:
        events.unregister("post_execute", _stop_profile)
    if _profiler is not None and _profiler.active:
        # Still inside the cell: the message belongs to it, and arrives before its end.
        get_ipython().data_pub.publish_data({PROFILE_KEY: _profiler.stop()})


def profile_so_far() -> RankProfile | None:
    """A rank still running a profiled cell (a hang): its profile up to now; the profiler stops."""
    if _profiler is None or not _profiler.active:
        return None
    return _profiler.stop()


def clock() -> float:
    """This rank's clock, for the notebook to measure its offset from its own."""
    import time

    return time.time()
