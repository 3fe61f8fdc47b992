"""What a user may do that nobody plans for: exit from a cell, Ctrl-C while starting, restart the
kernel mid-cell, a thousand cells, a hang among 32 ranks."""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

from ddp_magics.errors import DistributedCellError
from tests.conftest import (
    assert_gone,
    current_magics,
    run_cell,
    running_cluster,
    shown_text,
    start_kernel_with_cluster,
)


def test_ctrl_c_during_start_leaves_nothing_and_the_next_start_works(ip):
    magics = current_magics(ip)
    assert magics.cluster is None
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))  # start takes seconds
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt), capture_output():
            ip.run_line_magic("dist_start", "-n 2 --backend gloo")
    finally:
        timer.cancel()
    assert current_magics(ip).cluster is None
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert_gone(left, timeout=30)  # a bound on a loaded machine, not a wait
    with running_cluster(ip, 2):
        captured, error = run_cell(ip, "", "print(rank)")
        assert error is None and shown_text(captured) == "[rank 0]\n0\n[rank 1]\n1"


def test_a_hang_among_32_ranks_is_reported_in_a_few_lines(ip):
    magics = current_magics(ip)
    assert magics.cluster is None
    with running_cluster(ip, 32):
        _, error = run_cell(ip, "--timeout 3", "if rank != 5:\n    dist.barrier()\nprint(rank)")
        assert isinstance(error, DistributedCellError)
        summary = str(error)
        assert summary.startswith("ranks 0-4,6-31 still running after 3 s"), summary
        report = error._render_traceback_()
        assert len(report) < 60, "\n".join(report)
        assert any("ranks 0-4,6-31" in line and "line 2" in line for line in report), "\n".join(report)


def test_a_kernel_restarted_in_the_middle_of_a_cell_leaves_nothing(tmp_path):
    manager, client, processes, workdir = start_kernel_with_cluster(2)
    try:
        mark = f"pathlib.Path({str(tmp_path)!r}, str(rank)).touch()"
        client.execute(f"%%distributed\nimport pathlib, time\n{mark}\ntime.sleep(60)")
        deadline = time.monotonic() + 60
        while len(list(tmp_path.iterdir())) < 2:  # until the cell runs on both ranks
            assert time.monotonic() < deadline, "the cell did not start on both ranks"
            time.sleep(0.05)
        assert all(process.is_running() for process in processes)
        manager.restart_kernel(now=True)
        assert_gone(processes, timeout=30)  # a bound on a loaded machine, not a wait
        assert not workdir.exists()
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


def test_sys_exit_in_a_cell_is_a_rank_raising_not_a_dead_rank(ip, healthy):
    _, error = run_cell(ip, "", "import sys\nif rank == 1:\n    sys.exit(3)\nprint('on', rank)")
    assert isinstance(error, DistributedCellError)
    assert str(error).startswith("rank 1 raised SystemExit: 3")
    assert healthy.cluster.dead_ranks() == []
    captured, error = run_cell(ip, "", "dist.barrier()\nprint('still', rank)")
    assert error is None and "still 1" in shown_text(captured)


def test_os_exit_in_a_cell_is_a_dead_rank_and_restart_brings_it_back(ip, healthy):
    _, error = run_cell(ip, "", "import os\nif rank == 1:\n    os._exit(3)\nprint('on', rank)")
    assert isinstance(error, DistributedCellError)
    assert error.dead == [1]
    with capture_output():
        ip.run_line_magic("dist_restart", "")
    captured, error = run_cell(ip, "", "dist.barrier()\nprint('back', rank)")
    assert error is None and "back 1" in shown_text(captured)


def _open_files(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_a_thousand_cells_leave_descriptors_and_memory_flat(ip, healthy):
    cluster = healthy.cluster
    for _ in range(100):  # warm-up: caches, lazily made sockets
        run_cell(ip, "", "x = rank")
    engines = [info.pid for info in cluster.ranks]
    files_before = {pid: _open_files(pid) for pid in [os.getpid(), *engines]}
    memory_before = psutil.Process().memory_info().rss
    for number in range(1000):
        _, error = run_cell(ip, "", f"x = {number} + rank")
        assert error is None
    files_after = {pid: _open_files(pid) for pid in files_before}
    grown = {pid: files_after[pid] - files_before[pid] for pid in files_before}
    assert max(grown.values()) <= 2, grown
    memory_growth = psutil.Process().memory_info().rss - memory_before
    assert memory_growth < 40 * 2**20, f"the kernel grew {memory_growth / 2**20:.1f} MiB over 1000 cells"


def test_a_trace_that_cannot_start_says_so_in_one_line(ip, healthy):
    run_cell(ip, "", "dist.destroy_process_group()")
    try:
        _, error = run_cell(ip, "--trace tr", "print(rank)")
        assert isinstance(error, UsageError)
        message = str(error)
        assert message.startswith("--trace/--diagram: tracing could not start (rank 0: ValueError:")
        assert "rank 1: ValueError" in message and "\n" not in message
    finally:
        with capture_output():
            ip.run_line_magic("dist_restart", "")


@pytest.mark.parametrize(
    ("ending", "how"),
    [
        ("import ctypes; ctypes.string_at(0)", "killed by SIGSEGV (Segmentation fault), at cell line 3"),
        ("os.kill(os.getpid(), signal.SIGKILL)", "killed by SIGKILL (Killed)"),
        ("os._exit(7)", "exited with status 7"),
    ],
)
def test_a_rank_that_dies_is_reported_with_how_and_where(ip, healthy, ending, how):
    cell = f"import os, signal\nif rank == 1:\n    {ending}\nprint('alive', rank)"
    _, error = run_cell(ip, "", cell)
    assert isinstance(error, DistributedCellError) and error.dead == [1]
    report = error._render_traceback_()
    assert f"[rank 1] its engine process died: {how}" in report, "\n".join(report)
    if "SIGSEGV" in how:  # the crash's own stack, from the engine's log
        assert f"    line 3: {ending}" in report
        assert '      File "ctypes/__init__.py", in string_at' in report
    with capture_output():
        ip.run_line_magic("dist_restart", "")


def test_fifty_restarts_after_a_hang_in_a_row(ip, healthy):
    """A restart is the way out of a hang; it must never fail. Each new rendezvous listens on a
    port the system gives, held from bind to listen, so no old holder can be in its way."""
    ports = set()
    for _ in range(50):
        _, error = run_cell(ip, "--timeout 0.5", "if rank == 0:\n    dist.recv(torch.zeros(1), src=1)")
        assert isinstance(error, DistributedCellError)
        with capture_output():
            ip.run_line_magic("dist_restart", "")
        check = "import os\nt = torch.ones(1)\ndist.all_reduce(t)\nprint(os.environ['MASTER_PORT'])"
        captured, error = run_cell(ip, "", check)
        assert error is None
        ports.add(shown_text(captured).splitlines()[-1])
    assert len(ports) > 1  # a fresh port, not one reused by a fixed choice


def test_a_failed_restart_says_so_and_the_next_restart_starts_the_cluster_again(
    ip, healthy, tmp_path, monkeypatch
):
    """A restart that fails (here: the notebook's PYTHONPATH now shadows torch with a broken
    module, so the new zygote cannot import it) says what failed in one line, leaves nothing
    running, and the next %dist_restart, once the cause is gone, starts the cluster as it was."""
    processes = healthy.cluster.processes()
    (tmp_path / "torch.py").write_text("raise ImportError('a broken torch on PYTHONPATH')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    with pytest.raises(UsageError) as failed, capture_output():
        ip.run_line_magic("dist_restart", "")
    assert str(failed.value).startswith("%dist_restart failed: the engines' zygote exited")
    assert "a broken torch on PYTHONPATH" in str(failed.value)
    assert_gone(processes)
    _, error = run_cell(ip, "", "print(rank)")
    assert isinstance(error, UsageError)
    assert str(error) == (
        "No cluster is running: the last %dist_restart failed and stopped it (nothing of it is "
        "left); %dist_restart starts it again as it was"
    )
    monkeypatch.delenv("PYTHONPATH")
    with capture_output() as captured:
        ip.run_line_magic("dist_restart", "")
    assert captured.stdout.strip().endswith("2 ranks ready: backend gloo, world size 2, devices cpu x2")
    captured, error = run_cell(ip, "", "t = torch.ones(1)\ndist.all_reduce(t)\nprint(t.item())")
    assert error is None and shown_text(captured) == "[ranks 0,1]\n2.0"
