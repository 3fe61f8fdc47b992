"""Fixtures: one IPython shell with the extension loaded, and a real 2-rank gloo cluster."""

from __future__ import annotations

import json
import signal
import tempfile
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest
from IPython.testing.globalipapp import start_ipython
from IPython.utils.capture import capture_output
from jupyter_client.manager import start_new_kernel

from ddp_magics.lifetime import wait_for_exit
from ddp_magics.magics import DistributedMagics


def pytest_configure(config):
    # Tests press Ctrl-C as a user does in IPython (SIGINT to this process), where it raises
    # KeyboardInterrupt; a shell that started the run in the background left SIGINT ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def ip():
    shell = start_ipython()
    shell.run_line_magic("load_ext", "ddp_magics")
    yield shell
    shell.run_line_magic("unload_ext", "ddp_magics")


@pytest.fixture
def temp_dir(tmp_path, monkeypatch):
    """tempfile's directory (where the state root lives) moved to a fresh directory of the test's:
    what a test plants there is out of the other workers' reach (their %load_ext sweeps strays)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def current_magics(ip) -> DistributedMagics:
    """The loaded extension's magics (a reload, as test_shutdown does, makes a new instance)."""
    return next(m for m in ip.configurables if isinstance(m, DistributedMagics))


@pytest.fixture
def magics(ip) -> DistributedMagics:
    return current_magics(ip)


@contextmanager
def started_cluster(ip, start_line: str):
    """A cluster started by ``%dist_start start_line``, stopped (and checked gone) afterwards; yields
    the magics and what the start printed."""
    with capture_output() as started:
        ip.run_line_magic("dist_start", start_line)
    magics = current_magics(ip)
    try:
        yield magics, started.stdout
    finally:
        processes = magics.cluster.processes() if magics.cluster else []
        with capture_output():
            ip.run_line_magic("dist_stop", "")
        assert_gone(processes)


@contextmanager
def running_cluster(ip, world_size: int):
    """A running gloo cluster of ``world_size`` ranks, stopped (and checked gone) afterwards."""
    with started_cluster(ip, f"-n {world_size} --backend gloo") as (magics, _):
        yield magics


@pytest.fixture(scope="module")
def cluster(ip):
    """A running 2-rank gloo cluster for the module."""
    with running_cluster(ip, 2) as magics:
        yield magics


@pytest.fixture
def healthy(ip, cluster):
    """The module's cluster, restarted after a test that left ranks stuck or dead."""
    yield cluster
    if cluster.cluster is None or cluster.cluster.dead_ranks() or cluster.cluster.busy_ranks():
        with capture_output():
            ip.run_line_magic("dist_restart", "")


def assert_gone(processes: list[psutil.Process], timeout: float = 15) -> None:
    """Every process in the list has exited (checked by PID and start time; a zombie waiting
    for init to reap it has exited)."""
    running = wait_for_exit(processes, timeout=timeout)
    assert not running, f"still running: {[(p.pid, p.cmdline()) for p in running]}"


def run_cell(ip, line: str, cell: str):
    """Run ``%%distributed line`` + cell; returns (captured output, exception or None)."""
    with capture_output() as captured:
        result = ip.run_cell(f"%%distributed {line}\n{cell}")
    return captured, result.error_in_exec or result.error_before_exec


def shown_text(captured) -> str:
    """The text/plain of everything displayed, joined as nbval would see it."""
    texts = [output.data.get("text/plain", "") for output in captured.outputs]
    return "\n".join(texts)


def start_kernel_with_cluster(world_size: int):
    """A real ipykernel with a cluster of ``world_size`` ranks: (kernel manager, its client with
    channels started, the cluster's processes, its directory). The caller shuts both down."""
    manager, client = start_new_kernel(kernel_name="python3")
    try:
        code = (
            f"%load_ext ddp_magics\n%dist_start -n {world_size}\n"
            "import json\n"
            "m = next(m for m in get_ipython().configurables if type(m).__name__ == 'DistributedMagics')\n"
            "print(json.dumps([[p.pid for p in m.cluster.processes()], str(m.cluster.workdir)]))"
        )
        outputs = []
        reply = client.execute_interactive(code, timeout=120, output_hook=outputs.append)
        assert reply["content"]["status"] == "ok"
        texts = [m["content"]["text"] for m in outputs if m["msg_type"] == "stream"]
        pids, workdir = json.loads("".join(texts).strip().splitlines()[-1])
        return manager, client, [psutil.Process(pid) for pid in pids], Path(workdir)
    except BaseException:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
        raise
