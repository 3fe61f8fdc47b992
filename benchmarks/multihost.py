"""Two hosts against one, same run: ``%dist_start``, ``%dist_restart`` after a hang, ``%dist_stop``.

The two hosts are two network namespaces of this machine joined by a veth pair, each with its
own sshd (``tests/two_hosts.py``: needs root, iproute2 and openssh, as ``make test`` installs).
The notebook is an IPython shell inside namespace a. Each round runs, in an order that
alternates from round to round,

  one host:  ``%dist_start -n 2N --backend gloo``                 (engines forked by the zygote)
  two hosts: ``%dist_start --hosts A:N,B:N --backend gloo``       (engines forked by each host's
                                                                  zygote, started over ssh)

(N = ``--per-host``, 2 by default) and on each cluster: start until a first cell answers; the
median latency of 20 trivial cells (``x = 1``); a cell that hangs (rank 0 waits for the last rank,
``--timeout 1``) until its report is shown, less the second of timeout; ``%dist_restart`` until a
cell answers again; ``%dist_stop`` until no process of the cluster (controller, engines, nannies,
on either host) is left.

Targets (issue 25), medians of ``--rounds``: two-host start <= 1.5 x one-host, restart after a
hang <= 2 x one-host, two-host stop <= 0.5 s. Exits 1 if one is missed.

    sudo .venv/bin/python benchmarks/multihost.py                            # 5 rounds, 2x2 ranks
    sudo .venv/bin/python benchmarks/multihost.py --rounds 1                 # quick check
    sudo .venv/bin/python benchmarks/multihost.py --rounds 1 --per-host 16   # 32 ranks
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.two_hosts import HOST_A, HOST_B, TwoHosts, skip_reason  # noqa: E402

SSH_CONFIG_ENV = "DDP_MAGICS_BENCH_SSH_CONFIG"
START_RATIO, RESTART_RATIO, STOP_SECONDS = 1.5, 2.0, 0.5
HANG = "if rank == 0:\n    dist.recv(torch.zeros(1), src=world_size - 1)"
CHECK = "t = torch.ones(1)\ndist.all_reduce(t)\nassert t.item() == world_size"
HANG_TIMEOUT_SECONDS = 1
TRIVIAL_CELLS = 20
GONE_WITHIN_SECONDS = 60


# --------------------------------------------------------------------- inside namespace a
def measure_one(shell, start_line: str) -> dict[str, float]:
    """One cluster: its start, restart after a hang and stop, in seconds."""
    import psutil
    from IPython.utils.capture import capture_output

    from ddp_magics.magics import DistributedMagics

    magics = next(c for c in shell.configurables if isinstance(c, DistributedMagics))

    def cell(code: str, line: str = "") -> BaseException | None:
        with capture_output():
            result = shell.run_cell(f"%%distributed {line}\n{code}")
        return result.error_in_exec or result.error_before_exec

    started = time.perf_counter()
    with capture_output():
        shell.run_line_magic("dist_start", start_line)
    if cell(CHECK) is not None:
        raise RuntimeError(f"{start_line}: the first cell failed")
    start = time.perf_counter() - started

    latencies = []
    for _ in range(TRIVIAL_CELLS):
        started = time.perf_counter()
        cell("x = 1")
        latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    if cell(HANG, f"--timeout {HANG_TIMEOUT_SECONDS}") is None:
        raise RuntimeError(f"{start_line}: the hang did not hang")
    report = time.perf_counter() - started - HANG_TIMEOUT_SECONDS
    started = time.perf_counter()
    with capture_output():
        shell.run_line_magic("dist_restart", "")
    if cell(CHECK) is not None:
        raise RuntimeError(f"{start_line}: the first cell after the restart failed")
    restart = time.perf_counter() - started

    cluster = magics.cluster
    # Network namespaces share this machine's PIDs: the engines of host b are seen from a too.
    processes = cluster.processes() + [psutil.Process(info.pid) for info in cluster.ranks]
    started = time.perf_counter()
    with capture_output():
        shell.run_line_magic("dist_stop", "")
    deadline = time.monotonic() + GONE_WITHIN_SECONDS
    while any(_alive(p) for p in processes) and time.monotonic() < deadline:
        time.sleep(0.005)
    stop = time.perf_counter() - started
    left = [p.pid for p in processes if _alive(p)]
    if left:
        raise RuntimeError(f"{start_line}: still running {GONE_WITHIN_SECONDS} s after %dist_stop: {left}")
    return {
        "start": start,
        "latency": statistics.median(latencies),
        "report": report,
        "restart": restart,
        "stop": stop,
    }


def _alive(process) -> bool:
    import psutil

    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def worker(rounds: int, per_host: int) -> None:
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "ddp_magics")
    config = os.environ[SSH_CONFIG_ENV]
    shell.run_line_magic("config", f"DistributedMagics.ssh_command = ['ssh', '-F', {config!r}]")
    kinds = {
        "one host": f"-n {2 * per_host} --backend gloo",
        "two hosts": f"--hosts {HOST_A}:{per_host},{HOST_B}:{per_host} --backend gloo",
    }
    for round_number in range(rounds):
        order = list(kinds) if round_number % 2 == 0 else list(reversed(kinds))
        for kind in order:
            figures = measure_one(shell, kinds[kind])
            print(json.dumps({"kind": kind, **figures}), flush=True)


# --------------------------------------------------------------------- on this machine
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--per-host", type=int, default=2, help="ranks on each of the two hosts")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.rounds, args.per_host)
        return 0
    if skip_reason() is not None:
        print(f"cannot run: {skip_reason()}")
        return 1

    with TwoHosts(exit_grace=0) as hosts:
        inner = subprocess.run(
            hosts.in_a([sys.executable, __file__, "--worker", *sys.argv[1:]]),
            capture_output=True,
            text=True,
            env={**os.environ, SSH_CONFIG_ENV: hosts.ssh_config},
            cwd=ROOT,
            timeout=(120 + 20 * args.per_host) * args.rounds + 60,
        )
        left = {ns: [p.pid for p in ps] for ns, ps in hosts.leftovers(settle=5).items()}
    if inner.returncode != 0:
        print(inner.stdout[-3000:] + inner.stderr[-3000:])
        return 1
    samples: dict[str, dict[str, list[float]]] = {}
    for line in inner.stdout.splitlines():
        if line.startswith("{"):
            sample = json.loads(line)
            kind = samples.setdefault(sample.pop("kind"), {})
            for name, seconds in sample.items():
                kind.setdefault(name, []).append(seconds)

    def median(kind: str, name: str) -> float:
        return statistics.median(samples[kind][name])

    n = args.per_host
    print(f"{2 * n} ranks, gloo, medians of {args.rounds} rounds (one host: -n {2 * n}; two: A:{n},B:{n})")
    print(f"{'':28}{'one host':>10}{'two hosts':>11}{'ratio':>8}  target")
    failed = False
    for label, name in (("trivial cell (x = 1)", "latency"), ("hang report, past timeout", "report")):
        one, two = median("one host", name), median("two hosts", name)
        print(f"{label:28}{one:>9.3f}s{two:>10.3f}s{two / one:>8.1f}")
    for label, name, target, limit in (
        ("start until a cell answers", "start", f"ratio <= {START_RATIO}", START_RATIO),
        ("restart after a hang", "restart", f"ratio <= {RESTART_RATIO}", RESTART_RATIO),
        ("stop until nothing is left", "stop", f"two hosts <= {STOP_SECONDS} s", STOP_SECONDS),
    ):
        one, two = median("one host", name), median("two hosts", name)
        ratio = two / one
        missed = (two if name == "stop" else ratio) > limit
        failed |= missed
        print(f"{label:28}{one:>9.2f}s{two:>10.2f}s{ratio:>8.1f}  {target}: {'FAIL' if missed else 'pass'}")
    if any(left.values()):
        print(f"left running after the run: {left}")
        failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
