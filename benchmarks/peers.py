"""ddp-magics beside its peers, in the same run: nbdistributed and plain ipyparallel ``%px``.

Every system runs 2 CPU ranks (gloo) in a fresh interpreter of its own (two of them define
``%%distributed``), in an order that rotates from round to round, and is measured on:

  start:   from the start magic until a first cell has answered on every rank (nbdistributed:
           ``%dist_init -n 2``, then cells until one answers; ``%px``: ``ipyparallel.Cluster(n=2)``
           started and connected, then a ``%px`` cell that imports torch and forms the group);
  latency: median of 30 trivial cells (``x = 1``) after 5 untimed ones;
  hang:    rank 0 calls ``recv`` that nobody answers; how long until the notebook gets control
           back (ddp-magics: ``--timeout 3``; nbdistributed: its own request timeouts), or "never"
           within the limit (``%px`` waits for the ranks with no limit: run here in a thread, as
           the magic's own ``execute(block=True)``).

Processes of every system are stopped by PID (nbdistributed's ``%dist_shutdown`` and
``%dist_reset`` kill by name with ``pkill -f``, so they are never called here). Needs the bench
extra: ``pip install -c constraints.txt -e ".[bench]"``.

    .venv/bin/python benchmarks/peers.py              # 3 rounds
    .venv/bin/python benchmarks/peers.py --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

SYSTEMS = ("ddp-magics", "nbdistributed", "ipyparallel %px")
HANG_LIMIT_SECONDS = 40.0
TRIVIAL_CELLS, WARMUP_CELLS = 30, 5
HANG = "if rank == 0:\n    dist.recv(torch.zeros(1), src=1)"


# --------------------------------------------------------------- one system, one round
def shell_and_capture():
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output

    return InteractiveShell.instance(), capture_output


def timed(action) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def stop_by_pid(processes: list[psutil.Process]) -> None:
    from ddp_magics.lifetime import kill_now, wait_for_exit

    kill_now(wait_for_exit(processes, timeout=5))
    left = wait_for_exit(processes, timeout=5)
    if left:
        raise RuntimeError(f"could not stop {[p.pid for p in left]}")


def measure_ours() -> dict:
    shell, capture = shell_and_capture()
    with capture():
        shell.run_line_magic("load_ext", "ddp_magics")

    def start() -> None:
        with capture() as captured:
            shell.run_line_magic("dist_start", "-n 2 --backend gloo")
            shell.run_cell("%%distributed\nprint(rank, 'ready')")
        if "1 ready" not in "\n".join(o.data.get("text/plain", "") for o in captured.outputs):
            raise RuntimeError("ddp-magics: the first cell did not answer")

    result = {"start": timed(start), "first cell answered": True}
    result["latency"] = trivial_latency(lambda: shell.run_cell("%%distributed\nx = 1"), capture)
    with capture():
        hang = timed(lambda: shell.run_cell(f"%%distributed --timeout 3\n{HANG}"))
        shell.run_line_magic("dist_stop", "")
    result["hang"] = hang
    return result


def measure_nbdistributed() -> dict:
    shell, capture = shell_and_capture()
    # Its workers run `python` from PATH: make that this environment's.
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    with capture():
        shell.run_line_magic("load_ext", "nbdistributed")
    magic = next(m for m in shell.configurables if type(m).__name__ == "DistributedMagic")
    result: dict = {}
    started = time.perf_counter()
    try:
        with capture():
            shell.run_line_magic("dist_init", "-n 2")
        workers = [psutil.Process(p.pid) for p in magic._process_manager.processes]
        answered = []
        while time.perf_counter() - started < 2 * HANG_LIMIT_SECONDS:
            with capture() as captured:
                shell.run_cell("%%distributed\nprint('rank', rank, 'ready')")
            answered.append("Rank 1:" in captured.stdout and "ready" in captured.stdout)
            if answered[-1]:
                break
        result["start"] = time.perf_counter() - started if answered[-1] else None
        result["first cell answered"] = answered[0]
        result["latency"] = trivial_latency(lambda: shell.run_cell("%%distributed\nx = 1"), capture)
        with capture():  # it gives up by itself (its requests time out after 30 s)
            result["hang"] = timed(lambda: shell.run_cell(f"%%distributed\n{HANG}"))
    finally:
        with capture():
            type(magic).shutdown_all()  # by PID: terminate, then kill
        stop_by_pid(workers)
    return result


def measure_px() -> dict:
    import logging

    import ipyparallel as ipp

    shell, capture = shell_and_capture()
    cluster = ipp.Cluster(n=2, log_level=logging.WARNING)
    processes: list[psutil.Process] = []
    result: dict = {}
    try:
        form_group = (
            "import os, torch, torch.distributed as dist\n"
            "os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port))\n"
            "dist.init_process_group('gloo', rank=rank, world_size=2)\n"
            "print(rank, 'ready')"
        )

        def start() -> None:
            with capture():
                client = cluster.start_and_connect_sync(activate=True)
            processes.extend(psutil.Process().children(recursive=True))
            view = client[:]
            view.scatter("rank", [0, 1], flatten=True, block=True)
            view.push({"port": free_port()}, block=True)
            with capture() as captured:
                shell.run_cell_magic("px", "", form_group)
            if "1 ready" not in captured.stdout:
                raise RuntimeError(f"%px: the first cell did not answer: {captured.stdout!r}")

        result["start"] = timed(start)
        result["first cell answered"] = True
        result["latency"] = trivial_latency(lambda: shell.run_cell_magic("px", "", "x = 1"), capture)
        view = cluster.connect_client_sync()[:]
        hung = threading.Thread(target=lambda: view.execute(HANG, block=True), daemon=True)
        started = time.perf_counter()
        hung.start()
        hung.join(HANG_LIMIT_SECONDS)
        hang = time.perf_counter() - started
        result["hang"] = None if hung.is_alive() else hang
    finally:
        processes.extend(psutil.Process().children(recursive=True))
        stop_by_pid(processes)  # engines stuck in recv do not answer a graceful stop
        cluster.stop_cluster_sync()
    return result


def trivial_latency(run_cell, capture) -> float:
    times = []
    for index in range(WARMUP_CELLS + TRIVIAL_CELLS):
        with capture():
            elapsed = timed(run_cell)
        if index >= WARMUP_CELLS:
            times.append(elapsed)
    return statistics.median(times)


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


MEASURE = {"ddp-magics": measure_ours, "nbdistributed": measure_nbdistributed, "ipyparallel %px": measure_px}


# ------------------------------------------------------------------------ the table
def run_one(system: str) -> dict:
    completed = subprocess.run(
        [sys.executable, __file__, "--one", system], capture_output=True, text=True, timeout=600
    )
    lines = completed.stdout.strip().splitlines()
    if completed.returncode != 0 or not lines:
        return {"error": (completed.stderr.strip().splitlines() or ["no output"])[-1]}
    return json.loads(lines[-1])


def summarise(results: list[dict], key: str) -> float | str | None:
    values = [r.get(key) for r in results if "error" not in r]
    if not values:
        return "error"
    if key == "first cell answered":
        return f"{sum(bool(v) for v in values)}/{len(values)}"
    if any(v is None for v in values):
        return None
    return statistics.median(values)


def cell_text(value, unit: str) -> str:
    if value == "error" or isinstance(value, str):
        return value
    if value is None:
        return f"never (limit {HANG_LIMIT_SECONDS:g} s)" if unit == "s" else "n/a"
    return f"{value * 1000:.1f} ms" if unit == "ms" else f"{value:.2f} s"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--one", choices=SYSTEMS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(MEASURE[args.one]()))
        return 0

    results: dict[str, list[dict]] = {system: [] for system in SYSTEMS}
    for round_number in range(args.rounds):
        shift = round_number % len(SYSTEMS)
        for system in SYSTEMS[shift:] + SYSTEMS[:shift]:
            results[system].append(run_one(system))
            print(f"round {round_number + 1}, {system}: {results[system][-1]}", flush=True)

    metrics = [
        ("start until a cell answers", "start", "s"),
        ("first cell after start answered", "first cell answered", ""),
        ("trivial cell latency", "latency", "ms"),
        ("control back after a hang", "hang", "s"),
    ]
    width = 34
    print(f"\nmedians of {args.rounds} rounds, 2 CPU ranks (gloo)")
    print(f"{'metric':<{width}}" + "".join(f"{s:>26}" for s in SYSTEMS) + f"{'ours / best peer':>18}")
    for label, key, unit in metrics:
        values = {system: summarise(results[system], key) for system in SYSTEMS}
        peers = [v for s, v in values.items() if s != SYSTEMS[0] and isinstance(v, float)]
        ours = values[SYSTEMS[0]]
        ratio = f"{ours / min(peers):.2f}" if peers and isinstance(ours, float) else "-"
        print(
            f"{label:<{width}}"
            + "".join(f"{cell_text(values[s], unit):>26}" for s in SYSTEMS)
            + f"{ratio:>18}"
        )
    errors = {s: r["error"] for s, rs in results.items() for r in rs if "error" in r}
    for system, error in errors.items():
        print(f"{system} failed: {error}")
    return 1 if SYSTEMS[0] in errors else 0


if __name__ == "__main__":
    sys.exit(main())
