"""Every way a session ends leaves zero controller, engine or nanny processes."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap

import psutil
from IPython.utils.capture import capture_output
from jupyter_client.manager import start_new_kernel

from ddp_magics.cluster import stop_stray_clusters
from tests.conftest import assert_gone

# Starts a cluster in a fresh interpreter and prints the PIDs of everything it runs.
START_AND_REPORT = textwrap.dedent(
    """
    import json, sys
    from IPython.core.interactiveshell import InteractiveShell
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "ddp_magics")
    shell.run_line_magic("dist_start", "-n 2")
    magics = next(m for m in shell.configurables if type(m).__name__ == "DistributedMagics")
    print(json.dumps([p.pid for p in magics.cluster.processes()]), flush=True)
    if sys.argv[1] == "hang":
        sys.stdin.read()
    """
)


def _processes(pids: list[int]) -> list[psutil.Process]:
    return [psutil.Process(pid) for pid in pids]


def _cluster_processes(magics) -> list[psutil.Process]:
    processes = magics.cluster.processes()
    engines = {info.pid for info in magics.cluster.ranks}
    assert engines <= {p.pid for p in processes}
    assert len(processes) > len(engines) + 1, "expected the controller and nannies too"
    return processes


def test_dist_stop_leaves_nothing(ip, magics):
    with capture_output():
        ip.run_line_magic("dist_start", "-n 2")
    processes = _cluster_processes(magics)
    workdir = magics.cluster.workdir
    with capture_output() as captured:
        ip.run_line_magic("dist_stop", "")
    assert captured.stdout.strip() == "Stopped 2 ranks."
    assert_gone(processes, timeout=0.5)
    assert not workdir.exists()


def test_unload_ext_stops_the_cluster(ip, magics):
    with capture_output():
        ip.run_line_magic("dist_start", "-n 2")
    processes = _cluster_processes(magics)
    ip.run_line_magic("unload_ext", "ddp_magics")
    try:
        assert_gone(processes, timeout=0.5)
        assert "distributed" not in ip.magics_manager.magics["cell"]
    finally:
        ip.run_line_magic("load_ext", "ddp_magics")


def test_interpreter_exit_stops_the_cluster():
    result = subprocess.run(
        [sys.executable, "-c", START_AND_REPORT, "exit"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    pids = json.loads(result.stdout.strip().splitlines()[-1])
    assert pids
    gone = [pid for pid in pids if not psutil.pid_exists(pid)]
    assert gone == pids, f"left running after exit: {set(pids) - set(gone)}"


def test_kernel_shutdown_stops_the_cluster():
    manager, client = start_new_kernel(kernel_name="python3")
    try:
        code = (
            "%load_ext ddp_magics\n%dist_start -n 2\n"
            "import json\n"
            "m = next(m for m in get_ipython().configurables if type(m).__name__ == 'DistributedMagics')\n"
            "print(json.dumps([p.pid for p in m.cluster.processes()]))"
        )
        outputs = []
        reply = client.execute_interactive(code, timeout=120, output_hook=lambda msg: outputs.append(msg))
        assert reply["content"]["status"] == "ok"
        texts = [m["content"]["text"] for m in outputs if m["msg_type"] == "stream"]
        processes = _processes(json.loads("".join(texts).strip().splitlines()[-1]))
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=False)
    assert_gone(processes, timeout=15)


def test_strays_of_a_crashed_kernel_are_stopped_by_their_files():
    crashed = subprocess.Popen(
        [sys.executable, "-c", START_AND_REPORT, "hang"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = crashed.stdout.readline()
        while line and not line.startswith("["):
            line = crashed.stdout.readline()
        processes = _processes(json.loads(line))
        crashed.send_signal(signal.SIGKILL)
        crashed.wait(timeout=10)
        assert all(p.is_running() for p in processes), "the cluster should outlive its kernel"
    finally:
        crashed.kill()
        crashed.wait(timeout=10)
        crashed.stdout.close()
        crashed.stdin.close()
        stopped = stop_stray_clusters()
    assert [line for line in stopped if line.endswith(f"of process {crashed.pid}")]
    assert_gone(processes, timeout=15)
