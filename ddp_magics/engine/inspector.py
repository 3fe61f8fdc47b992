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

import faulthandler
import os
import select
import signal
import threading

from ddp_magics.engine import recorder
from ddp_magics.protocol import INSPECTION_KEY, STACK_DUMP_SIGNAL, Inspection

# faulthandler writes a dump in one go: once the pipe stays empty this long, the dump is whole.
DUMP_QUIET_SECONDS = 0.02
READ_CHUNK = 1 << 16

_started = False
_dump_pipe = None  # the write end, kept open for faulthandler


def start_inspector() -> None:
    """Once per engine: register faulthandler on the pipe and start the thread that reads it."""
    global _started, _dump_pipe
    if _started:
        return
    read_end, write_end = os.pipe()
    _dump_pipe = os.fdopen(write_end, "wb", buffering=0)
    faulthandler.register(STACK_DUMP_SIGNAL, file=_dump_pipe, all_threads=True)
    threading.Thread(target=_serve, args=(read_end,), name="ddp_magics inspector", daemon=True).start()
    _started = True


def _serve(read_end: int) -> None:
    # The signal must not land on this thread: its handler would write to a pipe only this
    # thread empties.
    signal.pthread_sigmask(signal.SIG_BLOCK, {STACK_DUMP_SIGNAL})
    answered = 0
    while True:
        dump = _read_dump(read_end)
        answered += 1
        _publish(Inspection(number=answered, stack=dump, events=recorder.events_so_far()))


def _read_dump(read_end: int) -> str:
    parts = [os.read(read_end, READ_CHUNK)]  # sleeps here, the GIL released, until a dump begins
    while select.select([read_end], [], [], DUMP_QUIET_SECONDS)[0]:
        parts.append(os.read(read_end, READ_CHUNK))
    return b"".join(parts).decode(errors="replace")


def _publish(inspection: Inspection) -> None:
    """A data message with the running cell as its parent (the engine's iopub is thread-safe)."""
    from IPython import get_ipython

    get_ipython().data_pub.publish_data({INSPECTION_KEY: inspection})
