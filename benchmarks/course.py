"""A course on this machine: K learners through the course hub (course/), against one learner alone.

As root (the hub runs each learner as a Unix user it makes here, and removes after). First one
learner alone (the reference), then K learners at once, each through the hub's REST API: a server,
a kernel, ``%dist_start -n RANKS`` and the first ``--cells`` distributed cells of lesson 06 (DDP).
Printed per learner: seconds to a ready server, to a started cluster, the cells' time; memory
(PSS of every process of the learner: server, kernel, cluster); then the CPU of all learners idle
over ``--window`` seconds, awake and parked (cluster/parking.py), and of the hub and its proxy.
For the reference learner, each process's memory (USS and PSS) after the cells.

    .venv/bin/python benchmarks/course.py --learners 10
    .venv/bin/python benchmarks/course.py --learners 2 --window 10   # a quick run

Leaves nothing behind: users, homes, processes, files in /tmp and /dev/shm, the hub's state.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.hub_helpers import (  # noqa: E402
    Hub,
    HubKernel,
    Learner,
    add_learner,
    missing_for_hub,
    processes_of,
    remove_learner,
)
from tests.ports import unused_port  # noqa: E402

MAGICS = "m = next(m for m in get_ipython().configurables if type(m).__name__ == 'DistributedMagics')\n"
TICKS = 100  # clock ticks per second (/proc/PID/stat)


def lesson_cells(count: int) -> list[str]:
    """The first ``count`` %%distributed cells of lesson 06 as committed, with the plain cells before
    them (its set-up); not its %load_ext / %dist_start, exercises or %dist_stop."""
    notebook = json.loads(subprocess.check_output(["git", "show", "HEAD:notebooks/06_ddp.ipynb"], cwd=REPO))
    cells, distributed = [], 0
    for cell in notebook["cells"]:
        code = "".join(cell["source"])
        skipped = ("%dist_start", "%dist_stop", "# Exercise")
        if cell["cell_type"] != "code" or any(mark in code for mark in skipped):
            continue
        if distributed == count:
            break
        distributed += code.startswith("%%distributed")
        cells.append(code)
    return cells


@dataclass
class Run:
    learner: Learner
    server_s: float = 0.0
    cluster_s: float = 0.0
    cells_s: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    kernel: HubKernel | None = None


def start_learner(hub: Hub, run: Run, ranks: int, cells: list[str], preload: bool = True) -> None:
    try:
        began = time.monotonic()
        hub.add_user(run.learner)
        url = hub.start_server(run.learner, within=600)
        run.server_s = time.monotonic() - began
        run.kernel = HubKernel(url, hub.token)
        began = time.monotonic()
        if not preload:  # the zygote takes the kernel's environment: as without the hub's preload
            run.kernel.execute("import os; os.environ.pop('DDP_MAGICS_ZYGOTE_PRELOAD', None)")
        _, error = run.kernel.execute(f"%load_ext ddp_magics\n%dist_start -n {ranks}", 600)
        run.cluster_s = time.monotonic() - began
        if error:
            run.errors.append(error)
            return
        for code in cells:
            began = time.monotonic()
            _, error = run.kernel.execute(code, 600)
            run.cells_s.append(time.monotonic() - began)
            if error:
                run.errors.append(f"{code.splitlines()[0]}... {error}")
    except Exception as error:  # reported in the table, the others go on
        run.errors.append(repr(error))


def ticks(pid: int) -> int | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
        return None


def cpu_percent(groups: dict[str, list[int]], window: float) -> dict[str, float]:
    """Each group's CPU over ``window`` seconds, in % of one core (processes there all along)."""
    before = {name: {pid: ticks(pid) for pid in pids} for name, pids in groups.items()}
    began = time.monotonic()
    time.sleep(window)
    elapsed = time.monotonic() - began
    shares = {}
    for name, pids in groups.items():
        used = 0
        for pid in pids:
            start, end = before[name][pid], ticks(pid)
            if start is not None and end is not None:
                used += end - start
        shares[name] = 100 * used / TICKS / elapsed
    return shares


def pss_mib(pid: int) -> tuple[float, float]:
    """(USS, PSS) of a process in MiB, from /proc/PID/smaps_rollup."""
    values = {}
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("Pss", "Private_Clean", "Private_Dirty"):
                values[key] = int(rest.split()[0])
    except OSError:
        return 0.0, 0.0
    unique = values.get("Private_Clean", 0) + values.get("Private_Dirty", 0)
    return unique / 1024, values.get("Pss", 0) / 1024


def role(pid: int, kernel_pids: set[int]) -> str:
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        threads = len(list(Path(f"/proc/{pid}/task").iterdir()))
        parent = int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
    except OSError:
        return "gone"
    if "jupyterhub-singleuser" in command:
        return "server"
    if "ipykernel" in command:
        return "kernel"
    if "ddp_magics.controller" in command:
        return "controller" if parent in kernel_pids else "controller's schedulers, heart monitor"
    if "ddp_magics.engine.zygote" in command:
        if parent in kernel_pids:
            return "zygote"
        return "engine (rank)" if threads > 6 else "nanny"
    return command[:40]


def learner_memory(learner: Learner) -> float:
    return sum(pss_mib(pid)[1] for pid in processes_of(learner.uid))


def breakdown(learner: Learner) -> list[tuple[str, int, float, float]]:
    pids = processes_of(learner.uid)
    kernels = {pid for pid in pids if role(pid, set()) == "kernel"}
    rows: dict[str, list] = {}
    for pid in pids:
        uss, pss = pss_mib(pid)
        row = rows.setdefault(role(pid, kernels), [0, 0.0, 0.0])
        row[0] += 1
        row[1] += uss
        row[2] += pss
    return sorted(((name, *values) for name, values in rows.items()), key=lambda row: -row[3])


def park_all(runs: list[Run], ranks: int, after: float | None) -> None:
    """Set every learner's parking time; with a time, wait until each one's ranks are stopped."""
    for run in runs:
        if run.kernel is not None and not run.errors:
            run.kernel.execute(MAGICS + f"m.cluster.park_after({after!r})", 60)
    if after is None:
        return
    deadline = time.monotonic() + 60 + after
    for run in runs:
        if run.kernel is None or run.errors:
            continue
        while sum(_stopped(pid) for pid in processes_of(run.learner.uid)) < ranks + 1:
            if time.monotonic() > deadline:
                run.errors.append("not parked within 60 s")
                break
            time.sleep(0.2)


def _stopped(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "T"
    except OSError:
        return False


def measure(
    hub: Hub, learners: list[Learner], ranks: int, cells: list[str], window: float, preload: bool = True
) -> dict:
    runs = [Run(learner) for learner in learners]
    threads = [threading.Thread(target=start_learner, args=(hub, run, ranks, cells, preload)) for run in runs]
    began = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    all_ready_s = time.monotonic() - began
    memory = {run.learner.name: learner_memory(run.learner) for run in runs}
    hub_pids = [hub.process.pid, *_children(hub.process.pid)]
    groups = {run.learner.name: processes_of(run.learner.uid) for run in runs}
    theirs = {pid for pids in groups.values() for pid in pids}
    groups["hub and proxy"] = [pid for pid in hub_pids if pid not in theirs]
    park_all(runs, ranks, None)
    awake = cpu_percent(groups, window)
    park_all(runs, ranks, 1.0)
    parked = cpu_percent(groups, window)
    first_cells = []
    for run in runs:  # the first cell after parking: the ranks continued
        if run.kernel is not None and not run.errors:
            began = time.monotonic()
            _, error = run.kernel.execute("%%distributed\nprint(rank)", 120)
            first_cells.append(time.monotonic() - began)
            if error:
                run.errors.append(f"after parking: {error}")
    return dict(runs=runs, memory=memory, awake=awake, parked=parked, all_ready_s=all_ready_s,
                after_parking_s=first_cells)


def _children(pid: int) -> list[int]:
    found = []
    for status in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(status.read_text().rpartition(")")[2].split()[1]) == pid:
                found.append(int(status.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return found


def close(runs: list[Run]) -> None:
    for run in runs:
        if run.kernel is not None:
            try:
                run.kernel.execute("%dist_stop", 120)
            except Exception as error:  # the server's stop ends the kernel and its cluster anyway
                run.errors.append(f"%dist_stop: {error!r}")
            run.kernel.close()
            run.kernel = None


def report(title: str, result: dict) -> None:
    runs: list[Run] = result["runs"]
    print(f"\n{title}: all ready in {result['all_ready_s']:.1f} s")
    header = f"{'learner':<12} server s  cluster s  cells s (each)"
    print(header.ljust(80) + "PSS MiB  idle awake %  parked %")
    for run in runs:
        name = run.learner.name
        cells = " ".join(f"{s:.2f}" for s in run.cells_s)
        line = f"{name:<12} {run.server_s:8.1f} {run.cluster_s:10.1f}  {sum(run.cells_s):6.2f} ({cells})"
        memory, awake, parked = result["memory"][name], result["awake"][name], result["parked"][name]
        numbers = f"{memory:7.0f}  {awake:12.2f}  {parked:8.2f}"
        print(line[:80].ljust(80) + numbers)
        for error in run.errors:
            print(f"    error: {error[:200]}")
    names = [run.learner.name for run in runs]
    awake = sum(result["awake"][name] for name in names)
    parked = sum(result["parked"][name] for name in names)
    median = statistics.median
    print(
        f"median: server {median(r.server_s for r in runs):.1f} s, cluster "
        f"{median(r.cluster_s for r in runs):.1f} s, cells {median(sum(r.cells_s) for r in runs):.2f} s, "
        f"PSS {median(result['memory'].values()):.0f} MiB; all learners idle: awake {awake:.2f} %, "
        f"parked {parked:.2f} % of a core; hub and proxy {result['awake']['hub and proxy']:.2f} % / "
        f"{result['parked']['hub and proxy']:.2f} %; first cell after parking "
        f"{statistics.median(result['after_parking_s'] or [0]):.2f} s (median)"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--learners", type=int, default=10)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--cells", type=int, default=4, help="lesson 06's first distributed cells run")
    parser.add_argument("--window", type=float, default=20.0, help="seconds of each idle CPU window")
    args = parser.parse_args()
    if missing := missing_for_hub():
        sys.exit(missing)
    cells = lesson_cells(args.cells)
    state = Path(tempfile.mkdtemp(prefix="ddp-course-bench-"))
    learners: list[Learner] = []
    hub = None
    runs: list[Run] = []
    try:
        learners = [add_learner("ddpb") for _ in range(args.learners + 2)]
        hub = Hub(state, unused_port())
        for learner, preload in ((learners[0], False), (learners[1], True)):
            alone = measure(hub, [learner], args.ranks, cells, args.window, preload)
            runs += alone["runs"]
            how = "with torch._dynamo imported by the zygote" if preload else "without the zygote's preload"
            report(f"one learner alone, {how}", alone)
            print("\nits processes after the cells (MiB):")
            print(f"{'process':<40}  count      USS      PSS")
            for name, count, uss, pss in breakdown(learner):
                print(f"{name:<40} {count:6d} {uss:8.0f} {pss:8.0f}")
            close(alone["runs"])
            hub.stop_server(learner)
        together = measure(hub, learners[2:], args.ranks, cells, args.window)
        runs += together["runs"]
        report(f"{args.learners} learners at once", together)
        close(together["runs"])
    finally:
        for run in runs:
            if run.kernel is not None:
                run.kernel.close()
        if hub is not None:
            hub.stop()
        left = []
        for learner in learners:
            left += remove_learner(learner)
        shutil.rmtree(state, ignore_errors=True)
        if left:
            print(f"left behind (removed now): {left}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
