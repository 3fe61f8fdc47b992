"""Hangs, a rank raising before a collective, killed engines, interrupts, bad input."""

from __future__ import annotations

import os
import re
import signal
import threading

import psutil
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

from ddp_magics.errors import DistributedCellError
from ddp_magics.stacks import short_path
from tests.conftest import assert_gone, run_cell, shown_text

RECV_NEVER_SENT = """\
t = torch.zeros(2)
print('waiting', rank)
if rank == 0:
    dist.recv(t, src=1)
"""


def test_stack_paths_lose_this_machines_directories():
    package_dir = os.path.dirname(os.path.abspath(short_path.__code__.co_filename))
    checkout = os.path.dirname(package_dir)
    venv_torch = f"{checkout}/.venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"
    assert short_path("/tmp/ipykernel_1/123.py", "/tmp/ipykernel_1/123.py") == "<cell>"
    assert short_path(f"{package_dir}/engine/recorder.py", "") == "ddp_magics/engine/recorder.py"
    assert short_path(venv_torch, "") == "torch/distributed/distributed_c10d.py"  # a venv inside the checkout
    assert short_path("/usr/lib/python3.11/threading.py", "") == "threading.py"
    assert short_path(f"{checkout}/script.py", "") == f"{checkout}/script.py"  # nothing to shorten it to


def test_hang_is_reported_with_line_and_call_then_restart_recovers(ip, healthy):
    captured, error = run_cell(ip, "--timeout 3", RECV_NEVER_SENT)
    assert isinstance(error, DistributedCellError)
    assert str(error) == "rank 0 still running after 3 s (rank 0 in recv at cell line 4)"
    assert shown_text(captured) == "[rank 0]\nwaiting 0\n[rank 1]\nwaiting 1"
    report = error._render_traceback_()
    assert "[rank 0] still running, in recv at cell line 4" in report
    assert "    line 4: dist.recv(t, src=1)" in report
    # Stack lines name the cell and the package file, not this machine's directories.
    assert '      File "<cell>", line 4, in <module>' in report
    assert any(line.startswith('      File "torch/distributed/distributed_c10d.py"') for line in report)
    assert not any('File "/' in line for line in report)
    assert "[rank 1] finished" in report
    assert report[-1].startswith("Run %dist_recover")

    # The stuck rank is not handed another cell behind the hung one.
    _, error = run_cell(ip, "", "print('queued?')")
    assert isinstance(error, UsageError)
    assert "rank 0 still running an earlier cell" in str(error)
    assert "busy" in repr(ip.run_line_magic("dist_status", ""))

    with capture_output():
        ip.run_line_magic("dist_restart", "")
    captured, error = run_cell(ip, "", "t = torch.tensor([rank + 1.0])\ndist.all_reduce(t)\nt.item()")
    assert error is None
    assert shown_text(captured) == "[ranks 0,1]\n3.0"


def test_raise_before_collective_releases_the_waiting_rank(ip, healthy, magics):
    magics.error_grace = 1.0
    try:
        _, error = run_cell(
            ip,
            "",
            "t = torch.ones(1)\nif rank == 0:\n    raise RuntimeError('rank 0 gave up')\ndist.all_reduce(t)",
        )
    finally:
        magics.error_grace = 5.0
    assert isinstance(error, DistributedCellError)
    assert str(error) == (
        "rank 0 raised RuntimeError: rank 0 gave up; "
        "rank 1 was waiting in all_reduce at cell line 4 and was released (state kept, new process group)"
    )
    report = "\n".join(error._render_traceback_())
    assert "rank 0 gave up" in report
    assert (
        "[rank 1] released: it was waiting in all_reduce at cell line 4, which no rank will join now"
        in report
    )
    assert "%dist_recover" not in report
    _, error = run_cell(ip, "", "dist.barrier()")  # no command typed in between
    assert error is None


def test_killed_engine_is_named_and_restart_brings_it_back(ip, healthy):
    victim = healthy.cluster.ranks[1]
    engine = psutil.Process(victim.pid)
    os.kill(victim.pid, signal.SIGKILL)
    engine.wait(timeout=10)

    _, error = run_cell(ip, "", "print('hello')")
    assert isinstance(error, UsageError)
    assert "rank 1 died" in str(error)
    table = ip.run_line_magic("dist_status", "")
    assert [row[4] for row in table.rows] == ["alive", "dead"]

    with capture_output():
        ip.run_line_magic("dist_restart", "")
    new_pid = healthy.cluster.ranks[1].pid
    assert new_pid != victim.pid
    captured, error = run_cell(ip, "", "dist.barrier()\nprint(rank)")
    assert error is None
    assert shown_text(captured) == "[rank 0]\n0\n[rank 1]\n1"


def test_interrupt_stops_the_ranks_and_keeps_the_cluster(ip, healthy):
    timer = threading.Timer(2.0, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        captured, error = run_cell(
            ip, "", "import time\nprint('start', rank)\nwhile True:\n    time.sleep(0.01)"
        )
    finally:
        timer.cancel()
    assert isinstance(error, DistributedCellError)
    assert str(error) == "ranks 0,1 were interrupted"
    assert error.usable
    assert shown_text(captured) == "[rank 0]\nstart 0\n[rank 1]\nstart 1"
    captured, error = run_cell(ip, "", "print('after interrupt', rank)")
    assert error is None
    assert shown_text(captured) == "[rank 0]\nafter interrupt 0\n[rank 1]\nafter interrupt 1"


def test_ranks_failing_alike_share_one_traceback_numbered_like_the_notebook(ip, healthy):
    with capture_output():
        result = ip.run_cell("%%distributed\nvalues = [rank]\nvalues[3]")
    error = result.error_in_exec
    assert isinstance(error, DistributedCellError)
    assert str(error) == "ranks 0,1 raised IndexError: list index out of range"
    report = _plain("\n".join(error._render_traceback_()))
    assert report.count("Traceback (most recent call last)") == 1
    assert "[ranks 0,1]\n" in report
    assert f"Cell In[{result.execution_count}], line 2" in report

    # A function defined in an earlier cell is named by that cell's notebook number too.
    with capture_output():
        defined = ip.run_cell("%%distributed\ndef fail(r):\n    raise ValueError(f'rank {r}')")
        result = ip.run_cell("%%distributed\nfail(rank)")
    report = _plain("\n".join(result.error_in_exec._render_traceback_()))
    assert "[rank 0]" in report and "[rank 1]" in report  # different messages: one traceback each
    assert f"Cell In[{defined.execution_count}], line 2, in fail" in report
    assert f"Cell In[{result.execution_count}], line 1" in report


def _plain(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def test_restart_after_a_hang_forks_fresh_ranks_from_the_same_zygote(ip, healthy):
    cluster = healthy.cluster
    zygote = _parent_of_the_ranks(cluster)
    controller = _controller(cluster.processes())
    old_ranks = [psutil.Process(info.pid) for info in cluster.ranks]
    _, error = run_cell(ip, "--timeout 2", RECV_NEVER_SENT)
    assert "rank 0 still running" in str(error)

    with capture_output() as captured:
        ip.run_line_magic("dist_restart", "")
    assert captured.stdout.strip() == "2 ranks ready: backend gloo, world size 2, devices cpu x2"
    assert_gone(old_ranks, timeout=0.5)
    assert not {info.pid for info in cluster.ranks} & {p.pid for p in old_ranks}
    assert _parent_of_the_ranks(cluster) == zygote and zygote.is_running()
    assert _controller(cluster.processes()) == controller
    captured, error = run_cell(ip, "", "t = torch.tensor([rank + 1.0])\ndist.all_reduce(t)\nt.item()")
    assert error is None
    assert shown_text(captured) == "[ranks 0,1]\n3.0"


def test_restart_after_the_notebook_environment_changed_imports_torch_in_the_new_one(ip, healthy):
    """torch reads TORCH_DISTRIBUTED_DEBUG once, on import: the new ranks need a new zygote."""
    level = "print(dist.get_debug_level())"
    assert shown_text(run_cell(ip, "", level)[0]) == "[ranks 0,1]\nDebugLevel.OFF"
    old_zygote = _parent_of_the_ranks(healthy.cluster)
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    try:
        with capture_output() as captured:
            ip.run_line_magic("dist_restart", "")
        assert captured.stdout.strip() == "2 ranks ready: backend gloo, world size 2, devices cpu x2"
        assert_gone([old_zygote], timeout=0.5)
        assert shown_text(run_cell(ip, "", level)[0]) == "[ranks 0,1]\nDebugLevel.DETAIL"
    finally:
        del os.environ["TORCH_DISTRIBUTED_DEBUG"]
        with capture_output():
            ip.run_line_magic("dist_restart", "")
    assert shown_text(run_cell(ip, "", level)[0]) == "[ranks 0,1]\nDebugLevel.OFF"


def _parent_of_the_ranks(cluster) -> psutil.Process:
    (parent,) = {psutil.Process(info.pid).parent() for info in cluster.ranks}
    return parent


def _controller(processes: list[psutil.Process]) -> list[psutil.Process]:
    """The controller and the schedulers it forked (they share its command line)."""
    return sorted(
        (p for p in processes if "-m ddp_magics.controller" in " ".join(p.cmdline())), key=lambda p: p.pid
    )
