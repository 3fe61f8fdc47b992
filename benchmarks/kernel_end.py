"""No orphans, whatever happens to the kernel: how long a cluster outlives its kernel.

For each world size, a real ipykernel (jupyter_client, as JupyterLab's server runs kernels) starts
a cluster with ``%dist_start -n N``; then the kernel ends, and the script times, by PID, until the
last process of the cluster (controller, schedulers, engines, nannies) has exited:

  shutdown: ``KernelManager.shutdown_kernel(now=False)``, the call JupyterLab's server makes for
            "Shut Down Kernel" (a shutdown request, a short wait, then a kill);
  sigkill:  SIGKILL of the kernel process (no atexit, nothing runs in the kernel).

Reference from the same run: when the kernel process itself was gone. Then ``--cycles``
``%dist_start``/``%dist_stop`` cycles in this process, with this process's open file descriptors,
child processes and the clusters' temporary directories counted before and after.

Target: every cluster process gone within 2 s of its kernel, and nothing left after the cycles.
Exits 1 when missed.

    .venv/bin/python benchmarks/kernel_end.py                      # 10 tries each, 50 cycles
    .venv/bin/python benchmarks/kernel_end.py --tries 1 --cycles 2 # quick check
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import time

import psutil
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output
from jupyter_client.manager import start_new_kernel

from ddp_magics.cluster.strays import clusters_root
from ddp_magics.lifetime import is_running

TARGET_SECONDS = 2.0
REPORT_PIDS = (
    "import json\n"
    "m = next(m for m in get_ipython().configurables if type(m).__name__ == 'DistributedMagics')\n"
    "print(json.dumps([p.pid for p in m.cluster.processes()]))"
)


def kernel_with_cluster(world_size: int):
    """A kernel running a cluster: (manager, kernel process, the cluster's processes)."""
    manager, client = start_new_kernel(kernel_name="python3")
    outputs: list[dict] = []
    try:
        code = f"%load_ext ddp_magics\n%dist_start -n {world_size} --backend gloo\n{REPORT_PIDS}"
        reply = client.execute_interactive(code, timeout=120, output_hook=outputs.append)
        if reply["content"]["status"] != "ok":
            raise RuntimeError(f"the kernel could not start a cluster: {reply['content']}")
    finally:
        client.stop_channels()
    text = "".join(m["content"]["text"] for m in outputs if m["msg_type"] == "stream")
    pids = json.loads(text.strip().splitlines()[-1])
    return manager, psutil.Process(manager.provisioner.pid), [psutil.Process(pid) for pid in pids]


def seconds_until_exited(processes: list[psutil.Process], start: float, limit: float = 60) -> float:
    """When the last process exited (a zombie has exited), measured from ``start``."""
    running = list(processes)
    while running and time.monotonic() - start < limit:
        running = [process for process in running if is_running(process)]
        time.sleep(0.005)
    if running:
        for process in running:
            process.kill()  # ours; the benchmark leaves nothing behind either
        return float("inf")
    return time.monotonic() - start


def end_kernel(how: str, world_size: int) -> tuple[float, float, int]:
    """(seconds until the kernel was gone, seconds until the cluster was gone, processes)."""
    manager, kernel, processes = kernel_with_cluster(world_size)
    start = time.monotonic()
    if how == "shutdown":
        manager.shutdown_kernel(now=False)
    else:
        kernel.send_signal(signal.SIGKILL)
    kernel_gone = seconds_until_exited([kernel], start)
    cluster_gone = seconds_until_exited(processes, start)
    manager.cleanup_resources()
    return kernel_gone, cluster_gone, len(processes)


def leftovers() -> dict[str, int]:
    me = psutil.Process()
    return {
        "child processes": len([p for p in me.children(recursive=True) if is_running(p)]),
        "open fds": me.num_fds(),
        "cluster dirs": len(list(clusters_root().glob("cluster-*"))),
    }


def start_stop_cycles(cycles: int) -> tuple[dict[str, int], dict[str, int]]:
    shell = InteractiveShell.instance()
    with capture_output():
        shell.run_line_magic("load_ext", "ddp_magics")
        # One cycle first, so imports and IPython's own files are not counted as leaks.
        shell.run_line_magic("dist_start", "-n 2 --backend gloo")
        shell.run_line_magic("dist_stop", "")
    before = leftovers()
    for _ in range(cycles):
        with capture_output():
            shell.run_line_magic("dist_start", "-n 2 --backend gloo")
            shell.run_cell("%%distributed\nx = rank")
            shell.run_line_magic("dist_stop", "")
    return before, leftovers()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tries", type=int, default=10)
    parser.add_argument("--cycles", type=int, default=50)
    args = parser.parse_args()

    ok = True
    print(
        f"{'kernel end':<10} {'n':>2}  {'kernel gone (median, max)':>26}  {'cluster gone (median, max)':>27}"
    )
    for how in ("shutdown", "sigkill"):
        for world_size in (2, 4):
            kernel_times, cluster_times, counts = [], [], []
            # Alternate nothing here: each try is one kernel's whole life.
            for _ in range(args.tries):
                kernel_gone, cluster_gone, count = end_kernel(how, world_size)
                kernel_times.append(kernel_gone)
                cluster_times.append(cluster_gone)
                counts.append(count)
            worst = max(cluster_times)
            ok &= worst <= TARGET_SECONDS
            kernel_median, cluster_median = statistics.median(kernel_times), statistics.median(cluster_times)
            print(
                f"{how:<10} {world_size:>2}  {kernel_median:>12.2f} s {max(kernel_times):>9.2f} s"
                f"  {cluster_median:>13.2f} s {worst:>9.2f} s   ({counts[0]} processes, {args.tries} tries)"
            )
    before, after = start_stop_cycles(args.cycles)
    print(f"\n{args.cycles} start/stop cycles (n=2, one cell each), before -> after:")
    for key in before:
        print(f"  {key}: {before[key]} -> {after[key]}")
    ok &= after["child processes"] == 0 and after["cluster dirs"] == 0
    ok &= after["open fds"] <= before["open fds"]
    verdict = "met" if ok else "MISSED"
    print(f"\ntarget: every cluster process gone within {TARGET_SECONDS:g} s, nothing left: {verdict}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
