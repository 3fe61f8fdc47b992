"""Lesson 04's rings against the built-in ``all_reduce``: bus bandwidth on 2 ranks, same cluster, same run.

The ring code is not copied here: the cells that define it (``ring-helpers``, ``naive-ring``,
``optimal-ring``, ``pipelined-pass-right`` and ``timing``) are read from
``notebooks/04_ring_allreduce.ipynb`` and run on a 2-rank gloo cluster, so this measures exactly what
the lesson teaches, with the pipelined ``pass_right`` and one thread per rank as in its section 8.

Each round times every algorithm once (the median of 3 calls, each call timed by the slowest rank),
in an order that rotates from round to round; a figure is the median over the rounds.

  algbw = S / t        busbw = algbw * 2(n-1)/n        (the nccl-tests definitions)

Target: at 128 MiB, busbw(optimal ring) / busbw(built-in) >= 0.8.  Exits 1 if it is missed.

    .venv/bin/python benchmarks/ring_allreduce.py                # 15 rounds
    .venv/bin/python benchmarks/ring_allreduce.py --rounds 3     # quick check
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import nbformat
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output

LESSON = Path(__file__).resolve().parent.parent / "notebooks" / "04_ring_allreduce.ipynb"
LESSON_CELLS = ("ring-helpers", "naive-ring", "optimal-ring", "pipelined-pass-right", "timing")
ALGORITHMS = ("naive ring", "optimal ring", "built-in")
SIZES_MIB = (8, 32, 128)
TARGET_SIZE_MIB, TARGET_RATIO = 128, 0.8
RANKS = 2


def lesson_code() -> str:
    """The source of the lesson's ring cells, without their ``%%distributed`` line."""
    cells = {cell.id: cell.source for cell in nbformat.read(LESSON, as_version=4).cells}
    missing = [name for name in LESSON_CELLS if name not in cells]
    if missing:
        sys.exit(f"{LESSON.name} has no cell with id {', '.join(missing)}")
    sources = []
    for name in LESSON_CELLS:
        first, _, body = cells[name].partition("\n")
        if first.strip() != "%%distributed":
            sys.exit(f"cell {name!r} of {LESSON.name} should start with %%distributed")
        sources.append(body)
    return "\n\n".join(sources)


def measure(shell: InteractiveShell, algorithm: str, size_mib: int) -> float:
    """Seconds for one all-reduce of ``size_mib`` MiB: median of 3 calls, slowest rank each."""
    with capture_output():
        shell.run_cell_magic(
            "distributed",
            "",
            f"seconds = seconds_per_call(ALGORITHMS[{algorithm!r}], {size_mib * 2**20 // 4}, repeats=3)",
        )
    return shell.run_line_magic("dist_pull", "seconds")[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "ddp_magics")
    samples: dict[tuple[int, str], list[float]] = {}
    try:
        with capture_output() as captured:
            shell.run_line_magic("dist_start", f"-n {RANKS} --backend gloo")
        print(captured.stdout.strip())
        with capture_output() as captured:
            shell.run_cell_magic("distributed", "", lesson_code())
        if captured.stdout.strip():
            print(captured.stdout.strip())
        for size in SIZES_MIB:
            for round_number in range(args.rounds):
                shift = round_number % len(ALGORITHMS)
                for algorithm in ALGORITHMS[shift:] + ALGORITHMS[:shift]:
                    samples.setdefault((size, algorithm), []).append(measure(shell, algorithm, size))
    finally:
        with capture_output():
            shell.run_line_magic("dist_stop", "")

    def busbw(size: int, algorithm: str) -> float:
        seconds = statistics.median(samples[size, algorithm])
        return size * 2**20 / seconds / 1e9 * 2 * (RANKS - 1) / RANKS

    print(f"all_reduce on {RANKS} ranks (gloo), median of {args.rounds} rounds")
    print(f"{'size':>8}  {'algorithm':13}{'time ms':>9}{'busbw GB/s':>12}{'/ built-in':>12}")
    for size in SIZES_MIB:
        for algorithm in ALGORITHMS:
            seconds = statistics.median(samples[size, algorithm])
            ratio = busbw(size, algorithm) / busbw(size, "built-in")
            print(
                f"{size:>4} MiB  {algorithm:13}{seconds * 1e3:>9.1f}"
                f"{busbw(size, algorithm):>12.2f}{ratio:>12.2f}"
            )
    ratio = busbw(TARGET_SIZE_MIB, "optimal ring") / busbw(TARGET_SIZE_MIB, "built-in")
    verdict = "pass" if ratio >= TARGET_RATIO else "FAIL"
    print(
        f"target: optimal ring busbw >= {TARGET_RATIO} x built-in at {TARGET_SIZE_MIB} MiB: "
        f"{ratio:.2f}, {verdict}"
    )
    return 0 if ratio >= TARGET_RATIO else 1


if __name__ == "__main__":
    sys.exit(main())
