"""Parking an idle cluster: its ranks (and the controller's heart monitor) stopped with ``SIGSTOP``
once nothing has used the cluster for a while, and continued with ``SIGCONT`` before its next use.

Why: an idle rank is not idle. gloo's TCP event loop wakes every 10 ms whether or not anything
is sent (``epoll_wait`` with a 10 ms timeout, one loop per rank), and ipyparallel's heartbeat
runs every period; a kernel with 4 idle ranks costs about 1 % of a core, and 30 learners of a
course on one server a third of a core before anyone runs a cell. A stopped process costs
nothing, keeps every byte of its memory and every connection (TCP's peers do not notice a
process that does not read for a while), and goes on where it was when continued: parking
loses nothing, so the learner's next cell runs as it would have.

Only a cluster whose engines are all on this machine is parked, never while a cell runs on it
(a cell past its timeout keeps it awake until its ranks answer), and the heart monitor is
stopped first and continued last, so it never counts a parked rank's silence. A rank killed
while parked is dead at once (``SIGKILL`` ends a stopped process); the next use continues the
others and finds it dead by its PID, as it would any dead rank. If the kernel ends while the
cluster is parked, its zygote and controller (never parked) kill the stopped processes, as they
would running ones.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator


class Parking:
    """Parks the processes ``pids()`` names after ``after`` seconds without use.

    ``pids()`` returns them in the order to stop them (continued in reverse); ``parkable()``
    says whether the cluster may be parked now (no cell running). :meth:`in_use` wraps every
    use of the cluster: it continues the processes first, and nothing is parked during it."""

    def __init__(self, after: float | None, pids: Callable[[], list[int]], parkable: Callable[[], bool]):
        self.after = after
        self._pids = pids
        self._parkable = parkable
        self._lock = threading.Condition()
        self._users = 0
        self._last_use = time.monotonic()
        self._parked: list[int] = []
        self.parked_times = 0  # how often it was parked (for %dist_status and tests)
        self._closed = False
        self._thread: threading.Thread | None = None
        self.set_after(after)

    @property
    def parked(self) -> bool:
        return bool(self._parked)

    @contextlib.contextmanager
    def in_use(self) -> Iterator[None]:
        with self._lock:
            self._users += 1
            self._continue()
        try:
            yield
        finally:
            with self._lock:
                self._users -= 1
                self._last_use = time.monotonic()
                self._lock.notify_all()

    def set_after(self, after: float | None) -> None:
        """Park once unused for ``after`` seconds (None or 0: never), counted from the last use."""
        with self._lock:
            self.after = after if after else None
            self._lock.notify_all()
            if self.after is not None and self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._watch, name="ddp_magics parking", daemon=True)
                self._thread.start()

    def park_now(self) -> bool:
        """Park at once if the cluster may be parked (tests, benchmarks); whether it is parked."""
        with self._lock:
            if not self._parked and self._users == 0 and self._parkable():
                self._stop()
            return self.parked

    def close(self) -> None:
        """Continue what is parked (a stop kills it next) and end the watching thread."""
        with self._lock:
            self._closed = True
            self._continue()
            self._lock.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5)

    def _watch(self) -> None:
        with self._lock:
            while not self._closed:
                if self.after is None:  # never, until set again
                    self._lock.wait()
                    continue
                due = self._last_use + self.after
                now = time.monotonic()
                if self._parked or self._users or now < due:
                    # Waits for the next use to end (notify) or the time to come: no polling.
                    self._lock.wait(None if self._parked or self._users else due - now)
                    continue
                if self._parkable():
                    self._stop()
                else:  # a cell still runs: look again a period later
                    self._last_use = now

    def _stop(self) -> None:
        stopped = []
        for pid in self._pids():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
        self._parked = stopped
        self.parked_times += 1

    def _continue(self) -> None:
        for pid in reversed(self._parked):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGCONT)
        self._parked = []
