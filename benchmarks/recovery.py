"""Report to usable: after a hang (or a killed rank), how long until every rank answers a cell
with a working all_reduce, by ``%dist_recover`` (state kept) against ``%dist_restart`` (new
engines, state lost) measured in the same run on the same 4-rank gloo cluster.

  restart (reference): a hang reported after ``--timeout 1``, then ``%dist_restart`` and a cell
                       whose all_reduce answers on every rank;
  recover, mismatched collectives: rank 0 in all_reduce, the others in broadcast; then
                       ``%dist_recover`` and the same cell, which also checks that a variable
                       set before the hang is still there on every rank;
  recover, a rank in while True: rank 1 spins in Python, the others wait in a barrier;
  recover, a killed rank: rank 2 SIGKILLed, replaced by a new engine.

Each measurement starts when the hang (or death) report has been shown. Rounds run every
measurement once, in an order that rotates from round to round. Target (median): recover after
mismatched collectives <= 2 s at n = 4. Exits 1 when missed.

    .venv/bin/python benchmarks/recovery.py               # 5 rounds
    .venv/bin/python benchmarks/recovery.py --rounds 1    # quick check
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output

N = 4
RECOVER_TARGET_SECONDS = 2.0
MISMATCH = (
    "%%distributed --timeout 1\nt = torch.ones(3)\n"
    "if rank == 0:\n    dist.all_reduce(t)\nelse:\n    dist.broadcast(t, 0)"
)
SPIN = "%%distributed --timeout 1\nif rank == 1:\n    while True:\n        pass\nelse:\n    dist.barrier()"
KILL = "%%distributed --ranks 2\nimport os\nos.kill(os.getpid(), 9)"
CHECK = (
    "%%distributed\nt = torch.ones(1)\ndist.all_reduce(t)\n"
    "print(rank, t.item(), globals().get('kept') == rank * 10)"
)


def shown(captured) -> str:
    return "\n".join(output.data.get("text/plain", "") for output in captured.outputs)


def time_way_out(shell: InteractiveShell, failure: str, magic: str, keeps_state: bool) -> float:
    with capture_output():
        shell.run_cell("%%distributed\nkept = rank * 10")
        failed = shell.run_cell(failure)
    if failed.error_in_exec is None:
        raise RuntimeError("the failure was not reported")
    started = time.perf_counter()
    with capture_output() as captured:
        shell.run_line_magic(magic, "")
        answered = shell.run_cell(CHECK)
    elapsed = time.perf_counter() - started
    text = shown(captured)
    expected_state = keeps_state and failure != KILL
    for rank in range(N):
        kept = expected_state or (keeps_state and rank != 2)
        if f"{rank} {float(N)} {kept}" not in text:
            raise RuntimeError(
                f"rank {rank} did not answer as expected after {magic}:\n{text}\n{answered.error_in_exec}"
            )
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds of every measurement (default: 5)")
    args = parser.parse_args()
    shell = InteractiveShell.instance()
    with capture_output():
        shell.run_line_magic("load_ext", "ddp_magics")
        shell.run_line_magic("dist_start", f"-n {N} --backend gloo")
    measurements = {
        "restart after a hang (reference)": lambda: time_way_out(shell, MISMATCH, "dist_restart", False),
        "recover, mismatched collectives": lambda: time_way_out(shell, MISMATCH, "dist_recover", True),
        "recover, a rank in while True": lambda: time_way_out(shell, SPIN, "dist_recover", True),
        "recover, a killed rank": lambda: time_way_out(shell, KILL, "dist_recover", True),
    }
    times: dict[str, list[float]] = {name: [] for name in measurements}
    names = list(measurements)
    try:
        for round_number in range(args.rounds):
            shift = round_number % len(names)
            for name in names[shift:] + names[:shift]:
                times[name].append(measurements[name]())
            print(
                f"round {round_number + 1}/{args.rounds}: " + ", ".join(f"{times[n][-1]:.2f}" for n in names)
            )
    finally:
        with capture_output():
            shell.run_line_magic("dist_stop", "")

    medians = {name: statistics.median(values) for name, values in times.items()}
    reference = medians[names[0]]
    print(f"\nn = {N}: medians of {args.rounds} rounds (min-max), ratio to the reference (%dist_restart)")
    for name in names:
        values = times[name]
        print(
            f"  {name:<34} {medians[name]:6.2f} s ({min(values):.2f}-{max(values):.2f})"
            f"  x{medians[name] / reference:4.2f}"
        )
    met = medians[names[1]] <= RECOVER_TARGET_SECONDS
    print(
        f"target: recover after mismatched collectives <= {RECOVER_TARGET_SECONDS} s: "
        + ("met" if met else "MISSED")
    )
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
