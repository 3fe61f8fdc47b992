"""How the cluster's operations grow with the number of ranks, on one host (and on two network
namespace hosts when run as root with sshd, ip and ssh installed).

For each n (default 8, 16, 32, 64), on a fresh gloo cluster:

  start        ``%dist_start -n N`` until the cluster answers;
  raw cell     ipyparallel's own ``view.execute("x = 1", block=True)`` on the same engines (the
               reference for the next line), median of ``--cells``;
  cell         ``%%distributed`` with ``x = 1``, median of ``--cells``, alternated with the raw one;
  hang report  ``--timeout 5``, rank 3 in ``recv``, the others in ``barrier``: the time from the
               cell's start to its report, less the timeout;
  recover      ``%dist_recover`` after that hang, until it has reported;
  next cell    a cell whose all_reduce answers on every rank, after the recovery;
  raise        rank 0 raises, the others wait in ``all_reduce``: the cell's end (the others
               released after ``error_grace``), then the next cell;
  stop         ``%dist_stop``.

Every cell after a recovery or release must work, or be refused in one line (a UsageError): the
script says FAILED otherwise. Goals at n = 64 on a 2-core machine: start <= 4 s, recover <= 5 s,
raise -> cell end <= error_grace + 2 s, cell <= 1.1x raw. Then the same on two hosts (network
namespaces of this machine with their own sshd, ``tests/two_hosts.py``; as root) with
``--per-host`` ranks each, the notebook in the first.

    .venv/bin/python benchmarks/scale.py                  # n = 8, 16, 32, 64
    .venv/bin/python benchmarks/scale.py -n 32 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT)]
from cell_latency import magics_of, raw_view  # noqa: E402

from tests.two_hosts import HOST_A, HOST_B, TwoHosts, skip_reason  # noqa: E402

SSH_CONFIG_ENV = "DDP_MAGICS_BENCH_SSH_CONFIG"
HANG = (
    "%%distributed --timeout {timeout:g}\nt = torch.zeros(1)\n"
    "if rank == 3:\n    dist.recv(t, src=0)\nelse:\n    dist.barrier()"
)
RAISE = "%%distributed\nif rank == 0:\n    raise ValueError('bad input')\ndist.all_reduce(torch.ones(1))"
CHECK = "%%distributed\nt = torch.ones(1)\ndist.all_reduce(t)\nprint(rank, int(t.item()), kept == rank)"
HANG_TIMEOUT = 5.0
GOALS_AT_64 = {"start": 4.0, "recover": 5.0}
CELL_RATIO_GOAL = 1.1


class Failed(Exception):
    pass


def timed(action) -> tuple[float, object]:
    started = time.perf_counter()
    result = action()
    return time.perf_counter() - started, result


def run(shell: InteractiveShell, cell: str):
    with capture_output() as captured:
        result = shell.run_cell(cell)
    return result.error_in_exec or result.error_before_exec, captured


def check_next_cell(shell: InteractiveShell, n: int, after: str) -> float:
    """The next cell answers on every rank with its state, or is refused in one line."""
    elapsed, (error, captured) = timed(lambda: run(shell, CHECK))
    if isinstance(error, UsageError):
        raise Failed(f"after {after}, the next cell was refused: {error}")
    text = "\n".join(output.data.get("text/plain", "") for output in captured.outputs) + captured.stdout
    missing = [rank for rank in range(n) if f"{rank} {n} True" not in text]
    if error is not None or missing:
        raise Failed(f"after {after}, ranks {missing} did not answer: {error!r}\n{text[-2000:]}")
    return elapsed


def measure(shell: InteractiveShell, n: int, cells: int, start_line: str | None = None) -> dict[str, float]:
    magics = magics_of(shell)
    got: dict[str, float] = {}
    start_line = start_line or f"-n {n} --backend gloo"
    got["start"], _ = timed(lambda: shell.run_line_magic("dist_start", start_line))
    try:
        run(shell, "%%distributed\nkept = rank")
        view = raw_view(magics.cluster)
        raw, ours = [], []
        for _ in range(cells):
            raw.append(timed(lambda: view.execute("x = 1", block=True))[0])
            ours.append(timed(lambda: run(shell, "%%distributed\nx = 1"))[0])
        got["raw cell"], got["cell"] = statistics.median(raw), statistics.median(ours)

        elapsed, (error, _) = timed(lambda: run(shell, HANG.format(timeout=HANG_TIMEOUT)))
        if error is None:
            raise Failed("the hang was not reported")
        got["hang report"] = elapsed - HANG_TIMEOUT
        try:
            got["recover"], _ = timed(lambda: shell.run_line_magic("dist_recover", ""))
        except UsageError as refused:
            raise Failed(str(refused)) from None
        got["next cell"] = check_next_cell(shell, n, "%dist_recover")

        elapsed, (error, _) = timed(lambda: run(shell, RAISE))
        if error is None or magics.cluster.busy_ranks():
            raise Failed(f"the raise did not release the others: {error}")
        got["raise -> end"] = elapsed
        got["next cell after release"] = check_next_cell(shell, n, "the release")
    finally:
        got["stop"], _ = timed(lambda: shell.run_line_magic("dist_stop", ""))
    return got


def two_hosts_worker(per_host: int, cells: int, rounds: int) -> None:
    """Inside namespace a: a cluster of ``per_host`` ranks on each of the two hosts, measured as
    the others are; one JSON line per round."""
    shell = InteractiveShell.instance()
    with capture_output():
        shell.run_line_magic("load_ext", "ddp_magics")
        config = os.environ[SSH_CONFIG_ENV]
        shell.run_line_magic("config", f"DistributedMagics.ssh_command = ['ssh', '-F', {config!r}]")
    hosts = f"--hosts {HOST_A}:{per_host},{HOST_B}:{per_host} --backend gloo"
    for _ in range(rounds):
        try:
            with capture_output():
                got = measure(shell, 2 * per_host, cells, hosts)
            print(json.dumps(got), flush=True)
        except Failed as failed:
            print(json.dumps({"failed": str(failed)}), flush=True)


def on_two_hosts(per_host: int, cells: int, rounds: int) -> tuple[list[dict[str, float]], list[str]]:
    """The same measurements on two network-namespace hosts of this machine (tests/two_hosts.py:
    root, iproute2 and openssh), the notebook in namespace a."""
    why_not = skip_reason()
    if why_not is not None:
        return [], [f"two hosts not measured: {why_not}"]
    with TwoHosts(exit_grace=0) as hosts:
        worker = [sys.executable, __file__, "--two-hosts-worker", str(per_host), "--cells", str(cells)]
        inner = subprocess.run(
            hosts.in_a([*worker, "--rounds", str(rounds)]),
            capture_output=True,
            text=True,
            env={**os.environ, SSH_CONFIG_ENV: hosts.ssh_config},
            cwd=ROOT,
            timeout=600 * rounds,
        )
        left = {ns: [p.pid for p in ps] for ns, ps in hosts.leftovers(settle=5).items() if ps}
    results, failures = [], []
    for line in inner.stdout.splitlines():
        if line.startswith("{"):
            got = json.loads(line)
            (failures.append(got["failed"]) if "failed" in got else results.append(got))
    if inner.returncode != 0:
        failures.append(f"the two-host worker exited {inner.returncode}: {inner.stderr[-2000:]}")
    if left:
        failures.append(f"left running on the two hosts: {left}")
    return results, failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, action="append", help="world sizes (default: 8 16 32 64)")
    parser.add_argument("--rounds", type=int, default=1, help="rounds per world size (default: 1)")
    parser.add_argument("--cells", type=int, default=20, help="trivial cells timed per round (default: 20)")
    parser.add_argument(
        "--per-host", type=int, default=16, help="ranks per host of the two-host case (0: none; default: 16)"
    )
    parser.add_argument("--two-hosts-worker", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.two_hosts_worker is not None:
        two_hosts_worker(args.two_hosts_worker, args.cells, args.rounds)
        return 0
    sizes = args.n or [8, 16, 32, 64]
    shell = InteractiveShell.instance()
    with capture_output():
        shell.run_line_magic("load_ext", "ddp_magics")
    error_grace = magics_of(shell).error_grace
    results: dict[int, list[dict[str, float]]] = {n: [] for n in sizes}
    failures = []
    for round_number in range(args.rounds):
        for n in sizes:
            try:
                with capture_output():
                    got = measure(shell, n, args.cells)
            except Failed as failed:
                failures.append(f"n={n} round {round_number + 1}: {failed}")
                print(f"n={n} round {round_number + 1}: FAILED: {failed}", flush=True)
                continue
            results[n].append(got)
            print(
                f"n={n} round {round_number + 1}: " + ", ".join(f"{k} {v:.3f}" for k, v in got.items()),
                flush=True,
            )
    columns: list[tuple[str, list[dict[str, float]]]] = [(f"n={n}", results[n]) for n in sizes]
    if args.per_host:
        two, problems = on_two_hosts(args.per_host, args.cells, args.rounds)
        columns.append((f"2x{args.per_host} hosts", two))
        failures.extend(problems)
    names = [
        "start",
        "raw cell",
        "cell",
        "hang report",
        "recover",
        "next cell",
        "raise -> end",
        "next cell after release",
        "stop",
    ]
    print(
        f"\nmedians in seconds over {args.rounds} round(s) "
        f"(error_grace {error_grace:g} s, hang --timeout {HANG_TIMEOUT:g} s)"
    )
    print(f"{'':<26}" + "".join(f"{label:>14}" for label, _ in columns))
    for name in [*names, "cell / raw"]:
        row = []
        for _, got in columns:
            if not got:
                row.append(f"{'-':>14}")
            elif name == "cell / raw":
                row.append(f"{statistics.median(r['cell'] / r['raw cell'] for r in got):>13.2f}x")
            else:
                row.append(f"{statistics.median(r[name] for r in got):>14.3f}")
        print(f"{name:<26}" + "".join(row))
    if results.get(64):
        at64 = {name: statistics.median(r[name] for r in results[64]) for name in names}
        ratio = statistics.median(r["cell"] / r["raw cell"] for r in results[64])
        goals = [
            ("start", at64["start"], GOALS_AT_64["start"]),
            ("recover", at64["recover"], GOALS_AT_64["recover"]),
            ("raise -> end", at64["raise -> end"], error_grace + 2.0),
            ("cell / raw", ratio, CELL_RATIO_GOAL),
        ]
        print(
            "goals at n=64: "
            + ", ".join(
                f"{name} {value:.2f} <= {goal:g}: {'met' if value <= goal else 'MISSED'}"
                for name, value, goal in goals
            )
        )
    for failure in failures:
        print("FAILED:", failure)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
