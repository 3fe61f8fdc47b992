"""A long session at n = 2: 500 trivial cells, then 50 traced cells, in a row, on one cluster.

Reports the notebook process's memory (RSS) and open file descriptors before and after each
phase, and the p50/p99 latency of each kind of cell. Before counting, 20 cells of each kind warm
up caches and imports. Target: RSS grows by under 20 MB and open fds by none over the whole run
(beyond that is a leak, not noise). Exits 1 when missed.

    .venv/bin/python benchmarks/soak.py
    .venv/bin/python benchmarks/soak.py --trivial 50 --traced 10   # quick check
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import psutil
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output

RSS_GROWTH_LIMIT_MB = 20
TRIVIAL = "%%distributed\nx = rank"
TRACED = "%%distributed --trace tr\nt = torch.ones(4) * rank\ndist.all_reduce(t)"
WARMUP = 20


def run(shell: InteractiveShell, cell: str, count: int) -> list[float]:
    times = []
    for _ in range(count):
        started = time.perf_counter()
        with capture_output():
            result = shell.run_cell(cell)
        times.append(time.perf_counter() - started)
        if not result.success:
            raise RuntimeError(f"a soak cell failed: {result.error_in_exec or result.error_before_exec!r}")
    return times


def footprint() -> tuple[float, int]:
    me = psutil.Process()
    return me.memory_info().rss / 2**20, me.num_fds()


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trivial", type=int, default=500)
    parser.add_argument("--traced", type=int, default=50)
    args = parser.parse_args()
    shell = InteractiveShell.instance()
    with capture_output():
        shell.run_line_magic("load_ext", "ddp_magics")
        shell.run_line_magic("dist_start", "-n 2 --backend gloo")
    try:
        run(shell, TRIVIAL, WARMUP)
        run(shell, TRACED, WARMUP)
        rows = [("start", *footprint(), None)]
        trivial = run(shell, TRIVIAL, args.trivial)
        rows.append((f"after {args.trivial} trivial cells", *footprint(), trivial))
        traced = run(shell, TRACED, args.traced)
        rows.append((f"after {args.traced} traced cells", *footprint(), traced))
    finally:
        with capture_output():
            shell.run_line_magic("dist_stop", "")

    print(f"{'':<28} {'RSS MB':>8} {'open fds':>9} {'p50 ms':>8} {'p99 ms':>8}")
    for label, rss, fds, times in rows:
        latency = (
            f"{1000 * statistics.median(times):8.1f} {1000 * percentile(times, 0.99):8.1f}" if times else ""
        )
        print(f"{label:<28} {rss:8.1f} {fds:9d} {latency}")
    rss_growth = rows[-1][1] - rows[0][1]
    fd_growth = rows[-1][2] - rows[0][2]
    ok = rss_growth < RSS_GROWTH_LIMIT_MB and fd_growth <= 0
    print(
        f"\ngrowth over the run: RSS {rss_growth:+.1f} MB, open fds {fd_growth:+d}; "
        f"target: under {RSS_GROWTH_LIMIT_MB} MB and no fd: {'met' if ok else 'MISSED'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
