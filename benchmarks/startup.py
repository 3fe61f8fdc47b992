"""Start, restart and stop, against the time of one torch import measured in the same run.

  reference: ``python -c "import torch.distributed"`` in a new process (what every engine once
             paid, one after another on a few cores);
  start:     ``%dist_start -n N --backend gloo`` until a first ``%%distributed`` cell has
             answered on every rank, at n = 2, 4 and 16;
  restart:   at n = 4 and 16, ranks hung on purpose (rank 0 blocked in a ``recv`` nobody sends,
             the cell reported after ``--timeout 1``), then ``%dist_restart`` until the next cell
             has answered with a working all_reduce;
  stop:      ``%dist_stop`` until every process of the cluster has exited (checked by PID).

Each round runs every measurement once, in an order that rotates from round to round.
Targets (medians): start <= 1.15 x reference at n = 2 and n = 4, restart <= 0.5 s at n = 4,
at n = 16 start <= 2.5 s and restart <= 1.2 s, stop <= 0.5 s. Exits 1 when one is missed.

    .venv/bin/python benchmarks/startup.py               # 5 rounds
    .venv/bin/python benchmarks/startup.py --rounds 1    # quick check
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output

from ddp_magics.lifetime import wait_for_exit

START_RATIO_TARGET = 1.15
RESTART_TARGET_SECONDS = 0.5
START_16_TARGET_SECONDS = 2.5
RESTART_16_TARGET_SECONDS = 1.2
STOP_TARGET_SECONDS = 0.5
HANG = "%%distributed --timeout 1\nif rank == 0:\n    dist.recv(torch.zeros(1), src=1)"
ALL_REDUCE = "%%distributed\nt = torch.ones(1)\ndist.all_reduce(t)\nprint(rank, t.item())"


def shown(captured) -> str:
    return "\n".join(output.data.get("text/plain", "") for output in captured.outputs)


def check_answered(captured, n: int, expected: str) -> None:
    text = shown(captured)
    if any(f"{rank} {expected}" not in text for rank in range(n)):
        raise RuntimeError(f"not every rank answered {expected!r}:\n{text}\n{captured.stdout}")


def magics(shell: InteractiveShell):
    return next(m for m in shell.configurables if type(m).__name__ == "DistributedMagics")


def time_import() -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch.distributed"], check=True)
    return time.perf_counter() - started


def time_start(shell: InteractiveShell, n: int) -> float:
    try:
        started = time.perf_counter()
        with capture_output() as captured:
            shell.run_line_magic("dist_start", f"-n {n} --backend gloo")
            shell.run_cell("%%distributed\nprint(rank, 'ready')")
        elapsed = time.perf_counter() - started
        check_answered(captured, n, "ready")
        return elapsed
    finally:
        with capture_output():
            shell.run_line_magic("dist_stop", "")


def time_restart_after_hang(shell: InteractiveShell, n: int) -> float:
    try:
        with capture_output() as captured:
            shell.run_line_magic("dist_start", f"-n {n} --backend gloo")
            hung = shell.run_cell(HANG)
        if "still running" not in str(hung.error_in_exec):
            raise RuntimeError(f"the hang was not reported: {hung.error_in_exec!r}")
        started = time.perf_counter()
        with capture_output() as captured:
            shell.run_line_magic("dist_restart", "")
            shell.run_cell(ALL_REDUCE)
        elapsed = time.perf_counter() - started
        check_answered(captured, n, f"{float(n)}")
        return elapsed
    finally:
        with capture_output():
            shell.run_line_magic("dist_stop", "")


def time_stop(shell: InteractiveShell, n: int) -> float:
    with capture_output():
        shell.run_line_magic("dist_start", f"-n {n} --backend gloo")
        shell.run_cell("%%distributed\nx = rank")
    processes = magics(shell).cluster.processes()
    started = time.perf_counter()
    with capture_output():
        shell.run_line_magic("dist_stop", "")
    left = wait_for_exit(processes, timeout=30)
    elapsed = time.perf_counter() - started
    if left:
        raise RuntimeError(f"still running after %dist_stop: {[p.pid for p in left]}")
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds of every measurement (default: 5)")
    args = parser.parse_args()
    shell = InteractiveShell.instance()
    with capture_output():
        shell.run_line_magic("load_ext", "ddp_magics")
    measurements = {
        "import torch.distributed (reference)": time_import,
        "start n=2 until a cell answers": lambda: time_start(shell, 2),
        "start n=4 until a cell answers": lambda: time_start(shell, 4),
        "restart after a hang, n=4": lambda: time_restart_after_hang(shell, 4),
        "stop n=4 until no process is left": lambda: time_stop(shell, 4),
        "start n=16 until a cell answers": lambda: time_start(shell, 16),
        "restart after a hang, n=16": lambda: time_restart_after_hang(shell, 16),
    }
    times: dict[str, list[float]] = {name: [] for name in measurements}
    names = list(measurements)
    for round_number in range(args.rounds):
        shift = round_number % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(measurements[name]())
        print(f"round {round_number + 1}/{args.rounds}: " + ", ".join(f"{times[n][-1]:.2f}" for n in names))

    medians = {name: statistics.median(values) for name, values in times.items()}
    reference = medians[names[0]]
    targets = {
        names[1]: (START_RATIO_TARGET * reference, f"<= {START_RATIO_TARGET} x reference"),
        names[2]: (START_RATIO_TARGET * reference, f"<= {START_RATIO_TARGET} x reference"),
        names[3]: (RESTART_TARGET_SECONDS, f"<= {RESTART_TARGET_SECONDS} s"),
        names[4]: (STOP_TARGET_SECONDS, f"<= {STOP_TARGET_SECONDS} s"),
        names[5]: (START_16_TARGET_SECONDS, f"<= {START_16_TARGET_SECONDS} s"),
        names[6]: (RESTART_16_TARGET_SECONDS, f"<= {RESTART_16_TARGET_SECONDS} s"),
    }
    print(f"\nmedians of {args.rounds} rounds (min-max), ratio to the reference")
    passed = True
    for name in names:
        values = times[name]
        line = (
            f"  {name:<38} {medians[name]:6.2f} s ({min(values):.2f}-{max(values):.2f})"
            f"  x{medians[name] / reference:4.2f}"
        )
        if name in targets:
            limit, description = targets[name]
            met = medians[name] <= limit
            passed &= met
            line += f"  target {description}: {'met' if met else 'MISSED'}"
        print(line)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
