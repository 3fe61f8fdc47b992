"""Stack dumps from a rank: never blocking the rank, never split in two, whole with many threads."""

from __future__ import annotations

import faulthandler
import fcntl
import os
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from contextlib import contextmanager

from ddp_magics.engine.inspector import DumpEnd, DumpReader, dump_pipe
from ddp_magics.errors import DistributedCellError
from ddp_magics.stack_dumps import parse_stack_dump
from tests.conftest import run_cell

THREADS = 32
DEPTH = 90
# 32 threads, each 90 calls deep, waiting.
DEEP_THREADS = textwrap.dedent(
    f"""
    import faulthandler, os, signal, sys, threading

    def deeper(level, ready, release):
        if level:
            return deeper(level - 1, ready, release)
        ready.release()
        release.wait()

    ready, release = threading.Semaphore(0), threading.Event()
    for _ in range({THREADS}):
        threading.Thread(target=deeper, args=({DEPTH}, ready, release), daemon=True).start()
    for _ in range({THREADS}):
        ready.acquire()
    """
)
DUMP_WITHOUT_A_READER = DEEP_THREADS + textwrap.dedent(
    """
    from ddp_magics.engine.inspector import dump_pipe
    read_end, write_end = dump_pipe()
    faulthandler.register(signal.SIGUSR1, file=os.fdopen(write_end, "wb", buffering=0), all_threads=True)
    for _ in range(8):  # several times what the pipe holds, and nobody reads
        os.kill(os.getpid(), signal.SIGUSR1)
    print("not blocked", flush=True)
    """
)


@contextmanager
def parked_threads(count: int, depth: int):
    """``count`` threads, each waiting ``depth`` calls deep while the block runs."""
    ready, release = threading.Semaphore(0), threading.Event()

    def deeper(level: int) -> None:
        if level:
            deeper(level - 1)
        else:
            ready.release()
            release.wait()

    threads = [threading.Thread(target=deeper, args=(depth,)) for _ in range(count)]
    for thread in threads:
        thread.start()
    for _ in threads:
        ready.acquire()
    try:
        yield
    finally:
        release.set()
        for thread in threads:
            thread.join()


def dump_all_threads() -> bytes:
    with tempfile.TemporaryFile() as file:
        faulthandler.dump_traceback(file, all_threads=True)
        file.seek(0)
        return file.read()


@contextmanager
def open_pipe():
    read_end, write_end = dump_pipe()
    try:
        yield read_end, write_end
    finally:
        os.close(read_end)
        os.close(write_end)


def read_while_writing(dump: bytes, split: int, pause: float = 0.1) -> str:
    """What a reader makes of ``dump`` written in two parts, ``pause`` seconds apart."""
    with open_pipe() as (read_end, write_end):

        def write_with_a_pause() -> None:
            os.write(write_end, dump[:split])  # as a writer descheduled mid-dump would
            time.sleep(pause)
            os.write(write_end, dump[split:])

        writer = threading.Thread(target=write_with_a_pause)
        writer.start()
        try:
            return DumpReader(read_end, DumpEnd.of_this_process()).next_dump()
        finally:
            writer.join()


def test_a_dump_written_with_a_pause_in_the_middle_is_read_whole():
    with parked_threads(THREADS, DEPTH):
        dump = dump_all_threads()
    assert len(dump) > 1 << 16  # more than a default pipe holds
    assert read_while_writing(dump, len(dump) // 2) == dump.decode()
    threads = parse_stack_dump(dump.decode())
    assert sum(len(frames) > DEPTH for frames in threads) == THREADS


def test_a_pause_after_a_thread_cut_at_100_frames_does_not_end_the_dump():
    with parked_threads(1, 150):
        dump = dump_all_threads()
    cut_stack_end = dump.index(b"\n  ...\n") + len(b"\n  ...\n")
    assert cut_stack_end < len(dump)  # the main thread's block comes after it
    assert read_while_writing(dump, cut_stack_end) == dump.decode()


def test_dumps_arriving_together_are_read_one_at_a_time():
    dump = dump_all_threads()
    with open_pipe() as (read_end, write_end):
        os.write(write_end, dump + dump)
        reader = DumpReader(read_end, DumpEnd.of_this_process())
        assert [reader.next_dump(), reader.next_dump()] == [dump.decode()] * 2


def test_a_dump_whose_end_never_comes_is_published_after_the_deadline_and_says_so():
    dump = dump_all_threads()
    with open_pipe() as (read_end, write_end):
        os.write(write_end, dump[: len(dump) // 2])
        text = DumpReader(read_end, DumpEnd.of_this_process(), deadline_seconds=0.2).next_dump()
    assert text.startswith(dump[: len(dump) // 2].decode())
    assert text.splitlines()[-1] == (
        "[stack dump incomplete: its end did not arrive within 0.2 s; "
        "a dump larger than the pipe (1,048,576 bytes) is cut short]"
    )


def test_a_dump_that_overflowed_the_pipe_says_parts_may_be_missing():
    with open_pipe() as (read_end, write_end), parked_threads(THREADS, DEPTH):
        fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, 1 << 16)
        faulthandler.dump_traceback(write_end, all_threads=True)  # what does not fit is dropped
        text = DumpReader(read_end, DumpEnd.of_this_process(), deadline_seconds=0.2).next_dump()
    assert text.splitlines()[-2:] == [
        "[stack dump incomplete: its end did not arrive within 0.2 s; "
        "a dump larger than the pipe (65,536 bytes) is cut short]",
        "[stack dump may have gaps: it filled the pipe (65,536 bytes) faster than it was read]",
    ]


def test_a_rank_whose_dumps_nobody_reads_is_not_blocked(tmp_path):
    (tmp_path / "dump_without_a_reader.py").write_text(DUMP_WITHOUT_A_READER)
    environment = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.getcwd()}"}
    finished = subprocess.run(
        [sys.executable, "-m", "dump_without_a_reader"],
        capture_output=True,
        text=True,
        timeout=60,
        env=environment,
    )
    assert finished.returncode == 0, finished.stderr
    assert finished.stdout == "not blocked\n"


# Run by ``python -c`` as exec'd code (as an xdist worker runs): the main thread's two outermost
# frames are both "<string>" in <module>. The dump is written in two parts, paused just after the
# first of them, where a reader that knew only the outermost frame would take the dump as ended.
EXEC_DUMP_READ = textwrap.dedent(
    """
    from tests.test_inspector_dumps import dump_all_threads, read_while_writing

    dump = dump_all_threads()
    upper_module_frame = dump.index(b" in <module>\\n") + len(b" in <module>\\n")
    assert upper_module_frame < len(dump), "the outermost frame must come after"
    text = read_while_writing(dump, upper_module_frame, pause=0.3)
    print("whole" if text == dump.decode() else f"cut short: {text[-200:]!r}", flush=True)
    """
)


def test_a_dump_from_code_exec_d_by_python_c_is_read_whole():
    finished = subprocess.run(
        [sys.executable, "-c", f"exec({EXEC_DUMP_READ!r})"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert finished.returncode == 0, finished.stderr
    assert finished.stdout == "whole\n"


def test_32_threads_of_a_hung_rank_reach_the_notebook_whole(ip, healthy):
    cell = DEEP_THREADS + "dist.barrier() if rank == 0 else None\n"
    _, error = run_cell(ip, "--timeout 3", cell)
    assert isinstance(error, DistributedCellError)
    assert [blocked.rank for blocked in error.blocked] == [0]
    assert error.blocked[0].dist_call == "barrier"
    inspection = healthy.cluster.inspect([0])[0]
    threads = parse_stack_dump(inspection.stack)
    assert sum(len(frames) > DEPTH and frames[-1].function == "_bootstrap" for frames in threads) == THREADS
    assert threads[-1][-1].function == "_run_module_as_main"
    assert "[stack dump" not in inspection.stack
