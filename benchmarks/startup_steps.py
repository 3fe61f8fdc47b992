"""Where a start and a restart spend their time, step by step, from the progress they report.

Each round starts a cluster of n gloo ranks (``RankCluster.start``, as ``%dist_start``), runs a
first cell, hangs rank 0 in a ``recv`` nobody sends, restarts (``RankCluster.restart``, as
``%dist_restart``) and runs a cell again; every progress line is timed as it arrives. A step is
the time from one line to the next:

  start:    controller + zygote import  -> engines forked and connected -> probe (a first
            round trip) -> group formed (rank 0's store, every rank's init_process_group) ->
            first cell answered
  restart:  old engines stopped -> new engines forked and connected -> probe -> group formed ->
            first cell answered

Medians over the rounds, with one ``import torch.distributed`` in a new process per round as
the reference. Run it with another checkout's package to compare (its directory first on the
path, as benchmarks/compare_trees.py does):

    .venv/bin/python benchmarks/startup_steps.py -n 4 --rounds 5
    cd ../other && PYTHONPATH=. ../main/.venv/bin/python ../main/benchmarks/startup_steps.py -n 4
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from IPython.testing.globalipapp import start_ipython
from startup import time_import  # the reference, as benchmarks/startup.py measures it (same folder)

from ddp_magics import arguments
from ddp_magics.cluster.rank_cluster import RankCluster

HANG = "if rank == 0:\n    dist.recv(torch.zeros(1), src=1)"
# The progress line that ends each step (its first words), in order.
START_STEPS = (
    ("controller + zygote import", "starting {n} engines"),
    ("engines forked and connected", "importing torch on the engines"),
    ("probe (one round trip)", "forming the"),
    ("group formed", None),  # start() returns
    ("first cell answered", None),
)
RESTART_STEPS = (
    ("old engines stopped", "starting {n} engines"),
    ("engines forked and connected", "importing torch on the engines"),
    ("probe (one round trip)", "forming the"),
    ("group formed", None),
    ("first cell answered", None),
)


def wait_for_cell(cluster: RankCluster, answers, seconds: float) -> bool:
    """Whether the cell answered within ``seconds``: the cluster answers for its cell, or (in an
    older tree, which compare_trees.py runs this against) the handle run_cell returned."""
    return answers.wait(seconds) if answers is not None else cluster.wait_for_cell(seconds)


def timed(cluster: RankCluster, restart: bool, n: int) -> list[float]:
    """The duration of each step of ``cluster.start`` (or ``restart``) and of its first cell."""
    steps = RESTART_STEPS if restart else START_STEPS
    expected = [first_words.format(n=n) for _, first_words in steps[:-2]]
    marks = {}
    started = time.perf_counter()

    def progress(line: str) -> None:
        for first_words in expected:
            if line.startswith(first_words):
                marks.setdefault(first_words, time.perf_counter())

    (cluster.restart if restart else cluster.start)(progress)
    ends = [marks[first_words] for first_words in expected]
    ends.append(time.perf_counter())
    wait_for_cell(cluster, cluster.run_cell("x = 1", list(range(n)), 3 if restart else 1), 60)
    ends.append(time.perf_counter())
    return [end - begin for begin, end in zip([started, *ends], ends)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=4, help="ranks (default: 4)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds (default: 5)")
    args = parser.parse_args()
    shell = start_ipython()
    shell.run_line_magic("load_ext", "ddp_magics")
    settings = next(m for m in shell.configurables if type(m).__name__ == "DistributedMagics")
    options = argparse.Namespace(n=args.n, backend="gloo", hosts=None, engines=None, ip=None, timeout=None)
    reference, start_steps, restart_steps = [], [], []
    for round_number in range(args.rounds):
        reference.append(time_import())
        cluster = RankCluster(arguments.start_config(options, settings))
        try:
            start_steps.append(timed(cluster, restart=False, n=args.n))
            time.sleep(3)  # the engines' after-start work is done (see engine.rank)
            if wait_for_cell(cluster, cluster.run_cell(HANG, list(range(args.n)), 2), 1):
                raise RuntimeError("the hang did not hang")
            restart_steps.append(timed(cluster, restart=True, n=args.n))
        finally:
            cluster.stop()
        print(f"round {round_number + 1}/{args.rounds} done", flush=True)

    print(f"\nn = {args.n}, medians of {args.rounds} rounds (seconds)")
    print(f"  {'import torch.distributed (reference)':<40} {statistics.median(reference):6.3f}")
    sections = (("start", START_STEPS, start_steps), ("restart", RESTART_STEPS, restart_steps))
    for title, steps, times in sections:
        print(f"  {title}")
        for index, (name, _) in enumerate(steps):
            print(f"    {name:<38} {statistics.median(t[index] for t in times):6.3f}")
        print(f"    {'total':<38} {statistics.median(sum(t) for t in times):6.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
