"""``torch.profiler`` on a rank for one cell (the engine side of ``--profile``).

``start_profile``, sent just before a cell, makes a profiler (CPU, and CUDA where the rank has a
GPU) that starts as the cell does (IPython's ``pre_execute``). As the cell ends
(``post_execute``, also when it raised) the profiler stops, and what it recorded is reduced to a
:class:`~ddp_magics.protocol.RankProfile` published to the notebook (``PROFILE_KEY``): each
thread's top-level ops, every ``c10d::`` call (also those DDP's reducer makes inside backward)
and every range of the backend moving data (``gloo:*`` on gloo's threads, NCCL's kernels on the
GPU), in seconds since the epoch on the rank's clock (kineto's times are). The notebook merges
the ranks' profiles (:mod:`ddp_magics.profile`). ``memory()`` answers ``%dist_status``.

The profiler's C++ side (kineto) writes lines with PIDs and times to file descriptor 2: they are
kept out of the cell's output (fd 2 goes to /dev/null while the profiler starts and stops).
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager

from ddp_magics.protocol import (
    COMMUNICATION,
    COMPUTE,
    LAUNCH,
    MARK,
    PROFILE_KEY,
    ProfiledSlice,
    RankMemory,
    RankProfile,
)

MAX_SLICES = 200_000  # per rank and cell
TOP_OPS = 8
BACKEND_PREFIXES = ("gloo:", "nccl:", "mpi:", "ucc:")
USER_SCOPE = 7  # torch's RecordScope::USER_SCOPE


class CellProfiler:
    """One cell's profiler on this rank."""

    def __init__(self) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        dist = torch.distributed
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = (
            (str(dist.get_backend()), dist.get_world_size()) if dist.is_initialized() else (None, None)
        )
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
        """The profiler's raw events (not its Python event tree, ten times slower to build)
        reduced to the slices the notebook needs, nesting found per thread by containment."""
        results = self._profile.profiler.kineto_results
        origin = results.trace_start_ns() / 1e9
        by_thread: dict[tuple[str, int], list] = {}
        for event in results.events():
            on_gpu = event.device_type().name == "CUDA"
            thread = event.device_resource_id() if on_gpu else event.start_thread_id()
            by_thread.setdefault(("cuda" if on_gpu else "cpu", thread), []).append(event)
        slices: list[ProfiledSlice] = []
        self_times: dict[str, list] = {}  # op -> [calls, self nanoseconds]
        left_out, last = 0, origin
        for (device, thread), events in by_thread.items():
            for name, start, end, kind, self_ns in _nested(events, device):
                last = max(last, end / 1e9)
                if kind not in (LAUNCH, COMMUNICATION, MARK):
                    totals = self_times.setdefault(name, [0, 0])
                    totals[0] += 1
                    totals[1] += self_ns
                if kind is None:
                    continue
                if len(slices) >= MAX_SLICES:
                    left_out += 1
                    continue
                slices.append(ProfiledSlice(name, start / 1e9, end / 1e9, thread, kind, device))
        top = sorted(
            ((name, calls, ns / 1e9) for name, (calls, ns) in self_times.items()), key=lambda op: -op[2]
        )
        return RankProfile(
            self.rank,
            tuple(slices),
            tuple(top[:TOP_OPS]),
            origin,
            last,
            self.activities,
            left_out,
            backend=self.world[0],
            world_size=self.world[1],
        )


def _nested(events: list, device: str):
    """(name, start ns, end ns, kind, self ns) of one thread's ops. Kind None: an op inside
    another op. ``record_function`` ranges (``DistributedDataParallel.forward``) are seen
    through: they may wait for communication; what runs inside them counts. Those inside no other
    range are kept as marks (a loop's steps), the others left out. Ops
    inside a backend's range on its own thread (gloo copying its buffers) are left out too; on
    the thread that calls the backend its ranges enclose nothing (an ``irecv``'s range lasts
    until the data came, while the thread computes)."""
    events = sorted(events, key=lambda e: (e.start_ns(), -e.duration_ns()))
    calls_backend = device == "cpu" and any(e.name().startswith("c10d::") for e in events)
    open_ranges: list[list] = []  # [end ns, 1 if an op else 0, children's ns, its row]
    rows = []
    ops_open = 0
    for event in events:
        start, end = event.start_ns(), event.end_ns()
        while open_ranges and open_ranges[-1][0] <= start:
            closed = open_ranges.pop()
            ops_open -= closed[1]
            closed[3][4] -= closed[2]
        name = event.name()
        communication = name.startswith(("c10d::", *BACKEND_PREFIXES))  # gloo's ranges are user-scoped
        annotation = (
            device == "cpu"
            and not communication
            and (event.scope() == USER_SCOPE or event.is_user_annotation())
        )
        if device == "cuda":
            kind = COMMUNICATION if "nccl" in name.lower() else COMPUTE
        elif name.startswith(BACKEND_PREFIXES):
            kind = COMMUNICATION
        elif name.startswith("c10d::"):
            kind = LAUNCH
        elif annotation or ops_open:
            kind = None
        else:
            kind = COMPUTE
        if annotation and not open_ranges:
            kind = MARK
        row = [name, start, end, kind, end - start, annotation]
        rows.append(row)
        if communication and calls_backend:
            continue
        if open_ranges:
            open_ranges[-1][2] += end - start
        open_ranges.append([end, 0 if annotation else 1, 0, row])
        ops_open += 0 if annotation else 1
    for closed in open_ranges:
        closed[3][4] -= closed[2]
    for name, start, end, kind, self_ns, annotation in rows:
        if not annotation or kind == MARK:
            yield name, start, end, kind, self_ns


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
    _unhook()  # an earlier cell's, if it never ran
    _profiler = CellProfiler()
    events = get_ipython().events
    events.register("pre_execute", _start_profile)
    events.register("post_execute", _stop_profile)


def _start_profile() -> None:
    """As the cell starts (so that its profile is the cell's, not the wait for it)."""
    from IPython import get_ipython

    get_ipython().events.unregister("pre_execute", _start_profile)
    if _profiler is not None:
        _profiler.start()


def _stop_profile() -> None:
    from IPython import get_ipython

    _unhook()
    if _profiler is not None and _profiler.active:
        # Still inside the cell: the message belongs to it, and arrives before its end.
        get_ipython().data_pub.publish_data({PROFILE_KEY: _profiler.stop()})


def _unhook() -> None:
    from IPython import get_ipython

    events = get_ipython().events
    for event, callback in (("pre_execute", _start_profile), ("post_execute", _stop_profile)):
        while callback in events.callbacks[event]:
            events.unregister(event, callback)


def clock() -> float:
    """This rank's clock, for the notebook to measure its offset from its own."""
    import time

    return time.time()


def memory() -> RankMemory:
    """This rank's memory (resident, unique, proportional) and, on a GPU, its device's allocated
    and reserved memory."""
    import psutil
    import torch

    process = psutil.Process()
    try:
        full = process.memory_full_info()  # reads /proc/PID/smaps: unique and proportional too
        pages = {"unique": full.uss, "proportional": getattr(full, "pss", None)}
        resident = full.rss
    except psutil.Error:
        pages, resident = {}, process.memory_info().rss
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return RankMemory(resident, **pages)
    return RankMemory(resident, torch.cuda.memory_allocated(), torch.cuda.memory_reserved(), **pages)
