"""Two hosts against one, same run: ``%dist_start``, ``%dist_restart`` after a hang, ``%dist_stop``.

The two hosts are two network namespaces of this machine joined by a veth pair, each with its
own sshd (``tests/two_hosts.py``: needs root, iproute2 and openssh, as ``make test`` installs).
The notebook is an IPython shell inside namespace a. Each round runs, in an order that
alternates from round to round,

  one host:  ``%dist_start -n 4 --backend gloo``                  (engines forked by the zygote)
  two hosts: ``%dist_start --hosts A:2,B:2 --backend gloo``       (every engine started over ssh)

and on each cluster: start until a first cell answers; a cell that hangs (rank 0 waits for rank 3,
``--timeout 1``), then ``%dist_restart`` until a cell answers again; ``%dist_stop`` until no
process of the cluster (controller, engines, nannies, on either host) is left.

Targets (issue 25), medians of ``--rounds``: two-host start <= 1.5 x one-host, restart after a
hang <= 2 x one-host, two-host stop <= 0.5 s. Exits 1 if one is missed.

    sudo .venv/bin/python benchmarks/multihost.py              # 5 rounds
    sudo .venv/bin/python benchmarks/multihost.py --rounds 1   # quick check
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
HANG = "if rank == 0:\n    dist.recv(torch.zeros(1), src=3)"
CHECK = "t = torch.ones(1)\ndist.all_reduce(t)\nassert t.item() == 4"
GONE_WITHIN_SECONDS = 30


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

    if cell(HANG, "--timeout 1") is None:
        raise RuntimeError(f"{start_line}: the hang did not hang")
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
    return {"start": start, "restart": restart, "stop": stop}


def _alive(process) -> bool:
    import psutil

    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def worker(rounds: int) -> None:
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "ddp_magics")
    config = os.environ[SSH_CONFIG_ENV]
    shell.run_line_magic("config", f"DistributedMagics.ssh_command = ['ssh', '-F', {config!r}]")
    kinds = {"one host": "-n 4 --backend gloo", "two hosts": f"--hosts {HOST_A}:2,{HOST_B}:2 --backend gloo"}
    for round_number in range(rounds):
        order = list(kinds) if round_number % 2 == 0 else list(reversed(kinds))
        for kind in order:
            figures = measure_one(shell, kinds[kind])
            print(json.dumps({"kind": kind, **figures}), flush=True)


# --------------------------------------------------------------------- on this machine
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.rounds)
        return 0
    if skip_reason() is not None:
        print(f"cannot run: {skip_reason()}")
        return 1

    with TwoHosts(exit_grace=0) as hosts:
        inner = subprocess.run(
            hosts.in_a([sys.executable, __file__, "--worker", "--rounds", str(args.rounds)]),
            capture_output=True,
            text=True,
            env={**os.environ, SSH_CONFIG_ENV: hosts.ssh_config},
            cwd=ROOT,
            timeout=120 * args.rounds + 60,
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

    print(f"4 ranks, gloo, medians of {args.rounds} rounds (one host: -n 4; two hosts: A:2,B:2 over ssh)")
    print(f"{'':28}{'one host':>10}{'two hosts':>11}{'ratio':>8}  target")
    failed = False
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
