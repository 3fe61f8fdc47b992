"""The inspector: one thread per engine that tells the notebook where the rank is, even while
the rank's main thread is blocked in a gloo or NCCL call.

The notebook sends ``STACK_DUMP_SIGNAL`` through the engine's nanny (ipyparallel's signal
request, so it reaches engines on any host). faulthandler answers it in C, whatever the main
thread is doing, by writing every thread's stack into a pipe; this thread, asleep on the
pipe's other end, wakes, adds the calls traced so far in the cell, and publishes both as a
data message (ipyparallel's ``datapub``) belonging to the running cell, on the engine's iopub
channel. Nothing goes through files, so the notebook can be on another host.

The signal handler must never wait for this thread: it may run on a thread holding the GIL,
which this thread needs to read. So the pipe is made large and its write end non-blocking: a
dump that does not fit is cut short, never waited on. And a dump is read until its last line
has arrived, which its own format tells (see :class:`DumpEnd`), not until the pipe goes quiet:
a writer descheduled mid-dump would otherwise split it in two.
"""

from __future__ import annotations

import contextlib
import faulthandler
import fcntl
import os
import re
import select
import signal
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ddp_magics.engine import recorder
from ddp_magics.protocol import INSPECTION_KEY, STACK_DUMP_SIGNAL, Inspection

# A dump whose end has not arrived this long after its first bytes is published as it is.
DUMP_DEADLINE_SECONDS = 2.0
PIPE_BYTES = 1 << 20  # room for hundreds of threads' stacks; Linux's default cap for a pipe

_started = False
_dump_pipe = None  # the write end, kept open for faulthandler


def start_inspector() -> None:
    """Once per engine: register faulthandler on the pipe and start the thread that reads it."""
    global _started, _dump_pipe
    if _started:
        return
    read_end, write_end = dump_pipe()
    _dump_pipe = os.fdopen(write_end, "wb", buffering=0)
    reader = DumpReader(read_end, DumpEnd.of_this_process())
    faulthandler.register(STACK_DUMP_SIGNAL, file=_dump_pipe, all_threads=True)
    threading.Thread(target=_serve, args=(reader,), name="ddp_magics inspector", daemon=True).start()
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


@dataclass(frozen=True)
class DumpEnd:
    """How faulthandler's dump of all threads ends in this process.

    CPython (Python/traceback.c, ``_Py_DumpTracebackThreads``) writes one block per thread,
    newest thread first, blocks separated by an empty line: a header ``Thread 0x...`` or
    ``Current thread 0x...`` ``(most recent call first):``, then ``  File "...", line N in
    name`` per frame, innermost first, at most 100 (then ``  ...``), or ``  <no Python frame>``.
    After 100 threads it writes a line ``...`` and stops. So the last block is the main
    thread's (the interpreter's first thread), and it ends with the main thread's outermost
    frames, which stay the same while the process lives (runpy's ``_run_code`` and
    ``_run_module_as_main`` for an engine; their line numbers are not relied on). Two of them,
    not one: the outermost frame's file and function may come again just above it (``python -c``
    running ``exec`` of code: two ``"<string>"`` frames in ``<module>``).
    """

    main_thread_id: int
    # The main thread's outermost frames, innermost first, as faulthandler writes them: (file,
    # function), file being '"/path/to/file.py"' or '???'. Empty where the dump did not reach them.
    bottom: tuple[tuple[bytes, bytes], ...]

    @classmethod
    def of_this_process(cls) -> DumpEnd:
        """Read off a dump of this process's threads, made now."""
        main_thread_id = threading.main_thread().ident
        with tempfile.TemporaryFile() as file:
            faulthandler.dump_traceback(file, all_threads=True)
            file.seek(0)
            dump = file.read()
        main_block = _thread_header(main_thread_id).search(dump)
        if main_block is None:
            return cls(main_thread_id, ())
        block_lines = dump[main_block.start() :].split(b"\n\n", 1)[0].splitlines()[1:]
        bottom = []
        for line in block_lines[-BOTTOM_FRAMES:]:
            frame = _FRAME_LINE.fullmatch(line)
            if frame is None:  # deeper than the 100 frames a dump shows
                return cls(main_thread_id, ())
            bottom.append((frame["file"], frame["function"]))
        return cls(main_thread_id, tuple(bottom))

    def last_line(self) -> re.Pattern[bytes]:
        """The lines that end the main thread's block (with the newline before them)."""
        ends = [re.escape(b"\n" + _FRAMES_LEFT_OUT), re.escape(b"\n" + _NO_PYTHON_FRAME)]
        if self.bottom:
            ends.append(
                b"".join(
                    rb"\n  File " + re.escape(file) + rb", line (?:\d+|\?\?\?) in " + re.escape(function)
                    for file, function in self.bottom
                )
                + rb"\n"
            )
        return re.compile(b"|".join(ends))


BOTTOM_FRAMES = 2
_FRAME_LINE = re.compile(rb"  File (?P<file>.+), line (?:\d+|\?\?\?) in (?P<function>.+)")
_FRAMES_LEFT_OUT = b"  ...\n"
_NO_PYTHON_FRAME = b"  <no Python frame>\n"
_THREADS_LEFT_OUT = b"\n\n...\n"


def _thread_header(thread_id: int) -> re.Pattern[bytes]:
    return re.compile(rb"^(?:Current thread|Thread) 0x0*%x\b" % thread_id, re.MULTILINE)


def complete_dump_length(data: bytes | bytearray, end: DumpEnd) -> int | None:
    """How many bytes at the start of ``data`` make one whole dump; None while its end is still
    to come. Bytes after it are the start of a next dump."""
    ends = []
    threads_left_out = data.find(_THREADS_LEFT_OUT)
    if threads_left_out >= 0:
        ends.append(threads_left_out + len(_THREADS_LEFT_OUT))
    main_block = _thread_header(end.main_thread_id).search(data)
    if main_block is not None:
        last_line = end.last_line().search(data, main_block.end())
        if last_line is not None:
            ends.append(last_line.end())
    return min(ends, default=None)


class DumpReader:
    """The read end of the dump pipe, read one whole dump at a time."""

    def __init__(self, read_end: int, end: DumpEnd, deadline_seconds: float = DUMP_DEADLINE_SECONDS) -> None:
        self.read_end = read_end
        self.end = end
        self.deadline_seconds = deadline_seconds
        self.capacity = fcntl.fcntl(read_end, fcntl.F_GETPIPE_SZ)
        self._next = bytearray()  # the start of the next dump, read along with the previous one

    def next_dump(self) -> str:
        """The next dump, whole; or as much of it as arrived in time, with a last line saying so."""
        data, self._next = self._next, bytearray()
        deadline = time.monotonic() + self.deadline_seconds
        filled_pipe = cut_short = False
        while (length := complete_dump_length(data, self.end)) is None:
            if data:  # a dump has begun: wait for its end, but not for ever
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([self.read_end], [], [], left)[0]:
                    cut_short = True
                    length = len(data)
                    break
            chunk = os.read(self.read_end, self.capacity)  # with no dump begun, sleeps here
            if not chunk:
                raise EOFError("the dump pipe's write end is closed")
            if not data:
                deadline = time.monotonic() + self.deadline_seconds
            # Writes that found the pipe full were dropped. After one was, the next read gets at
            # least half the pipe (faulthandler writes at most ~500 bytes at a time, so every
            # page but the last was more than half filled): a smaller read means none was.
            filled_pipe |= len(chunk) >= self.capacity // 2
            data += chunk
        self._next = data[length:]
        text = bytes(data[:length]).decode(errors="replace")
        notes = []
        if cut_short:
            notes.append(
                f"[stack dump incomplete: its end did not arrive within {self.deadline_seconds:g} s; "
                f"a dump larger than the pipe ({self.capacity:,} bytes) is cut short]"
            )
        if filled_pipe:
            notes.append(
                f"[stack dump may have gaps: it filled the pipe ({self.capacity:,} bytes) "
                "faster than it was read]"
            )
        if notes:
            text += ("" if text.endswith("\n") else "\n") + "\n".join(notes) + "\n"
        return text


def _serve(reader: DumpReader) -> None:
    # The signal must not land on this thread: its handler would write to a pipe only this
    # thread empties.
    signal.pthread_sigmask(signal.SIG_BLOCK, {STACK_DUMP_SIGNAL})
    answered = 0
    while True:
        dump = reader.next_dump()
        answered += 1
        _publish(Inspection(number=answered, stack=dump, events=recorder.events_so_far()))


def _publish(inspection: Inspection) -> None:
    """A data message with the running cell as its parent (the engine's iopub is thread-safe)."""
    from IPython import get_ipython

    get_ipython().data_pub.publish_data({INSPECTION_KEY: inspection})
