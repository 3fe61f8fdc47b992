"""This tree's start-up and cell latency against another checkout's, alternated in one run.

For a change that must not cost time (a move "behaviour unchanged"): each round runs
``benchmarks/startup.py --rounds 1`` and ``benchmarks/cell_latency.py`` once with this tree's
``ddp_magics`` and once with the other's (``PYTHONPATH``, engines included), the order of the
two alternating from round to round, then prints the medians of each and their ratio. With
``--steps N``, each round runs ``benchmarks/startup_steps.py -n N --rounds 1`` instead: the
start and restart of N ranks step by step.

    git worktree add --detach ../base <commit>
    .venv/bin/python benchmarks/compare_trees.py ../base --rounds 5
    .venv/bin/python benchmarks/compare_trees.py ../base --rounds 5 --steps 4
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
THIS_TREE = HERE.parent
STARTUP_NAMES = (
    "import (reference)",
    "start n=2",
    "start n=4",
    "restart after a hang n=4",
    "stop n=4",
    "start n=16",
    "restart after a hang n=16",
)
LATENCY_ROW = re.compile(r"^\s*(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s")


def run(script: str, arguments: list[str], tree: Path) -> str:
    environment = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(
        [sys.executable, str(HERE / script), *arguments],
        env=environment,
        cwd=tree,
        capture_output=True,
        text=True,
    )
    if not re.search(r"^(round 1/1|\s*\d+\s+[\d.]+)", done.stdout, re.MULTILINE):
        raise RuntimeError(f"{script} with {tree} failed:\n{done.stdout}\n{done.stderr}")
    return done.stdout


def startup_times(tree: Path) -> list[float]:
    line = next(
        line for line in run("startup.py", ["--rounds", "1"], tree).splitlines() if line.startswith("round")
    )
    return [float(value) for value in line.partition(": ")[2].split(", ")]


def latency_medians(tree: Path, sizes: list[int], cells: int) -> dict[int, float]:
    """Our median ms per cluster size (the raw and %px columns are printed by cell_latency.py)."""
    arguments = ["--sizes", *map(str, sizes), "--cells", str(cells)]
    medians = {}
    for line in run("cell_latency.py", arguments, tree).splitlines():
        row = LATENCY_ROW.match(line)
        if row:
            medians[int(row[1])] = float(row[4])
    return medians


def step_times(tree: Path, n: int) -> dict[str, float]:
    """``startup_steps.py``'s rows (``start: controller + zygote import`` -> seconds), one round."""
    times, section = {}, ""
    for line in run("startup_steps.py", ["-n", str(n), "--rounds", "1"], tree).splitlines():
        if line.startswith("    "):
            name, _, value = line.strip().rpartition(" ")
            times[f"{section}: {name.strip()}"] = float(value)
        elif line.startswith("  ") and line.strip() in ("start", "restart"):
            section = line.strip()
        elif line.strip().startswith("import torch.distributed"):
            times["import torch.distributed (reference)"] = float(line.split()[-1])
    return times


def compare_steps(trees: dict[str, Path], rounds: int, n: int) -> None:
    steps: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    for round_number in range(rounds):
        order = list(trees) if round_number % 2 == 0 else list(trees)[::-1]
        for name in order:
            steps[name].append(step_times(trees[name], n))
        print(f"round {round_number + 1}/{rounds} done ({' then '.join(order)})", flush=True)
    print(f"\nn = {n}, medians of {rounds} alternated rounds (seconds): this tree / other")
    for step in steps["this"][0]:
        mine = statistics.median(times[step] for times in steps["this"])
        theirs = statistics.median(times[step] for times in steps["other"])
        print(f"  {step:<48} {mine:7.3f} {theirs:7.3f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("other", type=Path, help="the other checkout (its ddp_magics is compared)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--cells", type=int, default=50)
    parser.add_argument("--steps", type=int, metavar="N", help="start and restart of N ranks, step by step")
    args = parser.parse_args()
    other = args.other.resolve()
    if not (other / "ddp_magics" / "__init__.py").exists():
        parser.error(f"{other} holds no ddp_magics package")
    trees = {"this": THIS_TREE, "other": other}
    if args.steps:
        compare_steps(trees, args.rounds, args.steps)
        return 0
    startup: dict[str, list[list[float]]] = {name: [] for name in trees}
    latency: dict[str, list[dict[int, float]]] = {name: [] for name in trees}
    for round_number in range(args.rounds):
        order = list(trees) if round_number % 2 == 0 else list(trees)[::-1]
        for name in order:
            startup[name].append(startup_times(trees[name]))
            latency[name].append(latency_medians(trees[name], args.sizes, args.cells))
        print(f"round {round_number + 1}/{args.rounds} done ({' then '.join(order)})", flush=True)

    print(f"\nmedians of {args.rounds} alternated rounds: this tree ({THIS_TREE}) / other ({other})")
    for index, name in enumerate(STARTUP_NAMES):
        mine = statistics.median(times[index] for times in startup["this"])
        theirs = statistics.median(times[index] for times in startup["other"])
        print(f"  {name:<28} {mine:7.3f} s  {theirs:7.3f} s  ratio {mine / theirs:5.2f}")
    for n in args.sizes:
        mine = statistics.median(medians[n] for medians in latency["this"])
        theirs = statistics.median(medians[n] for medians in latency["other"])
        print(
            f"  {'cell latency n=' + str(n):<28} {mine:7.2f} ms {theirs:7.2f} ms ratio {mine / theirs:5.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
