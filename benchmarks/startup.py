"""Start-up time: from ``%dist_start`` until a first ``%%distributed`` cell has answered.

  ours:      ``%dist_start -n 2 --backend gloo`` then ``%%distributed`` ``print(rank)``,
             through the real magics (engines, torch import, process group, first cell);
  reference: plain ipyparallel defaults doing the same work without our tuning:
             ``ipyparallel.Cluster(n=2)``, ``start_and_connect_sync()``, then
             ``client[:].execute("import torch", block=True)`` (3 s heartbeat, default
             engine delay, torch imported only after the engines connect).

The two alternate (which one goes first alternates too); stopping a cluster is not timed.
Target: median(ours) <= 3.5 s at n = 2.  Exits 1 if it is missed.

    .venv/bin/python benchmarks/startup.py               # 5 runs of each
    .venv/bin/python benchmarks/startup.py --repeats 1   # quick check
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time

import ipyparallel as ipp
import psutil
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output

TARGET_SECONDS = 3.5
TARGET_N = 2


def stop_cluster(shell: InteractiveShell) -> None:
    with capture_output():
        shell.run_line_magic("dist_stop", "")


def time_ours(shell: InteractiveShell, n: int) -> float:
    """Seconds from %dist_start until the first %%distributed cell has answered."""
    try:
        started = time.perf_counter()
        with capture_output() as captured:
            shell.run_line_magic("dist_start", f"-n {n} --backend gloo")
            shell.run_cell_magic("distributed", "", "print(rank)")
        elapsed = time.perf_counter() - started
    finally:
        stop_cluster(shell)
    text = "\n".join(output.data.get("text/plain", "") for output in captured.outputs)
    missing = [rank for rank in range(n) if f"[rank {rank}]\n{rank}" not in text]
    if missing:
        raise RuntimeError(f"ranks {missing} did not print their rank; captured:\n{text}")
    return elapsed


def time_reference(n: int) -> float:
    """Seconds for plain ipyparallel to start n engines and import torch on them."""
    cluster = ipp.Cluster(n=n, log_level=logging.WARNING)
    client = None
    try:
        started = time.perf_counter()
        with capture_output():  # wait_for_engines draws a progress bar on stderr
            client = cluster.start_and_connect_sync()
            client[:].execute("import torch", block=True)
        elapsed = time.perf_counter() - started
    finally:
        # The launchers start controller and engines as our children: note their PIDs
        # now, so that they can be waited for (and killed by PID if need be) once stopped.
        started_processes = psutil.Process().children(recursive=True)
        if client is not None:
            client.close()
        cluster.stop_cluster_sync()
        _, alive = psutil.wait_procs(started_processes, timeout=10)
        for process in alive:
            process.kill()
        psutil.wait_procs(alive, timeout=10)
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs of each kind (default: 5)")
    parser.add_argument("-n", type=int, default=TARGET_N, help=f"ranks/engines (default: {TARGET_N})")
    args = parser.parse_args()
    if args.repeats < 1 or args.n < 1:
        parser.error("--repeats and -n must be at least 1")

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "ddp_magics")
    ours: list[float] = []
    reference: list[float] = []
    try:
        for repeat in range(args.repeats):
            order = ("ours", "reference") if repeat % 2 == 0 else ("reference", "ours")
            for kind in order:
                if kind == "ours":
                    ours.append(time_ours(shell, args.n))
                    print(f"run {repeat + 1}/{args.repeats}  ours       {ours[-1]:6.2f} s", flush=True)
                else:
                    reference.append(time_reference(args.n))
                    print(f"run {repeat + 1}/{args.repeats}  reference  {reference[-1]:6.2f} s", flush=True)
    finally:
        stop_cluster(shell)

    ours_median = statistics.median(ours)
    reference_median = statistics.median(reference)
    print()
    print(f"start-up until the first cell has answered, n={args.n}, {args.repeats} runs each")
    print(f"  ours       median {ours_median:6.2f} s  (min {min(ours):.2f}, max {max(ours):.2f})")
    print(
        f"  reference  median {reference_median:6.2f} s  "
        f"(min {min(reference):.2f}, max {max(reference):.2f})  plain ipyparallel + import torch"
    )
    print(f"  ratio ours/reference {ours_median / reference_median:.2f}")
    if args.n != TARGET_N:
        print(f"  target: ours <= {TARGET_SECONDS} s median at n={TARGET_N} (not checked at n={args.n})")
        return 0
    passed = ours_median <= TARGET_SECONDS
    print(f"  target: ours <= {TARGET_SECONDS} s median at n={TARGET_N}: {'PASS' if passed else 'FAIL'}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
