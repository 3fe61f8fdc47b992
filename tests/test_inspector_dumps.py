"""Stack dumps from a rank: never blocking the rank, never split in two, whole with many threads."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from ddp_magics.engine.inspector import dump_pipe, read_dump
from ddp_magics.errors import DistributedCellError
from ddp_magics.stacks import parse_stack_dump
from tests.conftest import run_cell

THREADS = 32
DEPTH = 90
# Started as ``python -m`` (as engines are): 32 threads, each 90 calls deep, waiting.
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
PRINT_A_DUMP = DEEP_THREADS + "faulthandler.dump_traceback(sys.stdout, all_threads=True)\n"
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


def _run_module(tmp_path, name: str, code: str, timeout: float) -> subprocess.CompletedProcess:
    (tmp_path / f"{name}.py").write_text(code)
    environment = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.getcwd()}"}
    return subprocess.run(
        [sys.executable, "-m", name], capture_output=True, text=True, timeout=timeout, env=environment
    )


@pytest.fixture(scope="module")
def real_dump(tmp_path_factory) -> str:
    printed = _run_module(tmp_path_factory.mktemp("dump"), "print_a_dump", PRINT_A_DUMP, timeout=60)
    assert printed.returncode == 0, printed.stderr
    return printed.stdout


def test_a_dump_written_with_a_pause_in_the_middle_is_read_whole(real_dump):
    assert len(real_dump) > 1 << 16  # more than a default pipe holds
    read_end, write_end = dump_pipe()
    data = real_dump.encode()
    middle = len(data) // 2

    def write_with_a_pause():
        os.write(write_end, data[:middle])  # as a writer descheduled mid-dump would
        time.sleep(0.1)
        os.write(write_end, data[middle:])

    writer = threading.Thread(target=write_with_a_pause)
    writer.start()
    try:
        assert read_dump(read_end) == real_dump
    finally:
        writer.join()
        os.close(read_end)
        os.close(write_end)
    threads = parse_stack_dump(real_dump)
    assert len(threads) == THREADS + 1
    assert threads[-1][-1].function == "_run_module_as_main"


def test_a_dump_that_never_ends_whole_is_published_after_the_deadline_and_says_so():
    read_end, write_end = dump_pipe()
    try:
        os.write(write_end, b'Thread 0x00007f (most recent call first):\n  File "x.py", line 1 in f\n')
        started = time.monotonic()
        text = read_dump(read_end)
        assert text.endswith("(this stack dump is incomplete)\n")
        assert time.monotonic() - started < 5
    finally:
        os.close(read_end)
        os.close(write_end)


def test_a_rank_whose_dumps_nobody_reads_is_not_blocked(tmp_path):
    finished = _run_module(tmp_path, "dump_without_a_reader", DUMP_WITHOUT_A_READER, timeout=60)
    assert finished.returncode == 0, finished.stderr
    assert finished.stdout == "not blocked\n"


def test_32_threads_of_a_hung_rank_reach_the_notebook_whole(ip, healthy):
    cell = DEEP_THREADS + "dist.barrier() if rank == 0 else None\n"
    _, error = run_cell(ip, "--timeout 3", cell)
    assert isinstance(error, DistributedCellError)
    assert [blocked.rank for blocked in error.blocked] == [0]
    assert error.blocked[0].dist_call == "barrier"
    inspection = healthy.cluster.inspect(healthy._unfinished, [0])[0]
    threads = parse_stack_dump(inspection.stack)
    assert len(threads) >= THREADS + 1  # and the engine's own threads
    assert threads[-1][-1].function == "_run_module_as_main"
    assert "incomplete" not in inspection.stack
