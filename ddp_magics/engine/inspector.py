"""The inspector: one thread per engine that tells the notebook where the rank is, even while
the rank's main thread is blocked in a gloo or NCCL call.

The notebook sends ``STACK_DUMP_SIGNAL`` through the engine's nanny (ipyparallel's signal
request, so it reaches engines on any host). faulthandler answers it in C, whatever the main
thread is doing, by writing every thread's stack into a pipe; this thread, asleep on the
pipe's other end, wakes, adds the calls traced so far in the cell, and publishes both as a
data message (ipyparallel's ``datapub``) belonging to the running cell, on the engine's iopub
channel. Nothing goes through files, so the notebook can be on another host.
"""

from __future__ import annotations

import contextlib
import faulthandler
import fcntl
import os
import select
import signal
import threading
import time
from pathlib import Path

from ddp_magics.engine import recorder
from ddp_magics.protocol import INSPECTION_KEY, STACK_DUMP_SIGNAL, Inspection

# faulthandler writes a dump in one go; a pause this long means it is done, if it reads whole.
DUMP_QUIET_SECONDS = 0.02
# A dump that does not read whole (its writer was descheduled, the pipe overflowed) is published
# as it is after this long.
DUMP_DEADLINE_SECONDS = 2.0
READ_CHUNK = 1 << 16
PIPE_BYTES = 1 << 20  # room for hundreds of threads' stacks; Linux's default cap for a pipe
# faulthandler lists the main thread last (threads newest first), and an engine, started as
# ``python -m``, has ``_run_module_as_main`` at the bottom of its main thread. Past 100 frames or
# 100 threads faulthandler ends a stack or the dump with "...".
WHOLE_DUMP_ENDINGS = (" in _run_module_as_main\n", "\n  ...\n", "\n...\n")

_started = False
_dump_pipe = None  # the write end, kept open for faulthandler


def start_inspector() -> None:
    """Once per engine: register faulthandler on the pipe and start the thread that reads it."""
    global _started, _dump_pipe
    if _started:
        return
    read_end, write_end = dump_pipe()
    _dump_pipe = os.fdopen(write_end, "wb", buffering=0)
    faulthandler.register(STACK_DUMP_SIGNAL, file=_dump_pipe, all_threads=True)
    threading.Thread(target=_serve, args=(read_end,), name="ddp_magics inspector", daemon=True).start()
    _started = True


def dump_pipe() -> tuple[int, int]:
    """A pipe for stack dumps whose writer never blocks: a rank answering ``STACK_DUMP_SIGNAL``
    writes from a signal handler, and must not wait for a reader. Large, so a dump fits whole;
    should one not fit, the rest of it is lost, never the rank."""
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    # Refused past the user's pipe quota (/proc/sys/fs/pipe-user-pages-soft): then the default
    # 64 KiB stays, still without blocking the rank.
    with contextlib.suppress(PermissionError):
        fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, min(PIPE_BYTES, _pipe_max_size()))
    return read_end, write_end


def _pipe_max_size() -> int:
    try:
        return int(Path("/proc/sys/fs/pipe-max-size").read_text())
    except (OSError, ValueError):
        return PIPE_BYTES


def _serve(read_end: int) -> None:
    # The signal must not land on this thread: its handler would write to a pipe only this
    # thread empties.
    signal.pthread_sigmask(signal.SIG_BLOCK, {STACK_DUMP_SIGNAL})
    answered = 0
    while True:
        dump = read_dump(read_end)
        answered += 1
        _publish(Inspection(number=answered, stack=dump, events=recorder.events_so_far()))


def read_dump(read_end: int, endings: tuple[str, ...] = WHOLE_DUMP_ENDINGS) -> str:
    """The next dump from the pipe, whole: after a quiet pause, reading goes on while the text
    does not end as a whole dump does, up to ``DUMP_DEADLINE_SECONDS``."""
    parts = [os.read(read_end, READ_CHUNK)]  # sleeps here, the GIL released, until a dump begins
    deadline = time.monotonic() + DUMP_DEADLINE_SECONDS
    while True:
        if select.select([read_end], [], [], DUMP_QUIET_SECONDS)[0]:
            parts.append(os.read(read_end, READ_CHUNK))
            continue
        text = b"".join(parts).decode(errors="replace")
        if text.endswith(endings):
            return text
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return text + "\n(this stack dump is incomplete)\n"
        if select.select([read_end], [], [], remaining)[0]:
            parts.append(os.read(read_end, READ_CHUNK))


def _publish(inspection: Inspection) -> None:
    """A data message with the running cell as its parent (the engine's iopub is thread-safe)."""
    from IPython import get_ipython

    get_ipython().data_pub.publish_data({INSPECTION_KEY: inspection})
