"""Per-cell latency of ``%%distributed`` against raw ipyparallel on the same cluster.

For each cluster size a cluster is started with ``%dist_start -n N --backend gloo``; then,
interleaved (the order of A and B alternates from one iteration to the next), a trivial
cell ``x = 1`` is run

  A. raw:  ``view.execute("x = 1", block=True)`` on a DirectView of the cluster's engines
     (silent: no execute_input or result messages, nothing waited for but the replies);
  B. %px:  ipyparallel's own ``%%px`` magic on the same view (not silent, outputs shown);
  C. ours: ``%%distributed`` through the real magic (rendering, error checks and all).

Targets: median(ours) / median(raw) <= 1.3, and median(ours) - median(%px) <= 1 ms (what the
magic adds to ipyparallel's own cell magic).  Exits 1 if any size misses one.

    .venv/bin/python benchmarks/cell_latency.py                      # n = 2, 4; 100 cells
    .venv/bin/python benchmarks/cell_latency.py --sizes 2 --cells 10  # quick check
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output

from ddp_magics.magics import DistributedMagics

CELL = "x = 1"
TARGET_RATIO = 1.3
TARGET_OVER_PX_MS = 1.0


def percentile(samples: list[float], fraction: float) -> float:
    """Nearest-rank percentile (``fraction`` in 0..1)."""
    ordered = sorted(samples)
    return ordered[max(math.ceil(fraction * len(ordered)) - 1, 0)]


def magics_of(shell: InteractiveShell) -> DistributedMagics:
    for configurable in shell.configurables:
        if isinstance(configurable, DistributedMagics):
            return configurable
    raise RuntimeError("ddp_magics is not loaded in this shell")


def raw_view(cluster):
    """A DirectView of the cluster's engines on the cluster's own ipyparallel client (a second
    client can miss the first output messages it subscribes to, and wait for them forever).
    Older trees, which benchmarks/compare_trees.py runs this against, kept it on the cluster."""
    engines = getattr(cluster, "engines", None)
    if engines is not None:
        return engines._client[engines.engine_ids()]
    return cluster._client[cluster.engine_ids()]


def stop_cluster(shell: InteractiveShell) -> None:
    with capture_output():
        shell.run_line_magic("dist_stop", "")


def measure(shell: InteractiveShell, n: int, cells: int, warmup: int) -> dict:
    """Start an n-rank cluster, time ``cells`` cells of each kind on it, stop it."""
    try:
        with capture_output() as captured:
            shell.run_line_magic("dist_start", f"-n {n} --backend gloo")
        print(f"  {captured.stdout.strip()}", flush=True)
        view = raw_view(magics_of(shell).cluster)

        def raw() -> float:
            started = time.perf_counter()
            view.execute(CELL, block=True)
            return time.perf_counter() - started

        def ours() -> float:
            started = time.perf_counter()
            with capture_output():
                shell.run_cell_magic("distributed", "", CELL)
            return time.perf_counter() - started

        view.block = True  # %px waits for the ranks, as in a notebook's default view
        view.activate()  # ipyparallel's %px magics, on this view

        def px() -> float:
            started = time.perf_counter()
            with capture_output():
                shell.run_cell_magic("px", "", CELL)
            return time.perf_counter() - started

        kinds = (raw, px, ours)
        for _ in range(warmup):
            for kind in kinds:
                kind()
        times: dict = {kind: [] for kind in kinds}
        for iteration in range(cells):
            shift = iteration % len(kinds)  # each kind in each place of the order, in turn
            for kind in kinds[shift:] + kinds[:shift]:
                times[kind].append(kind())
    finally:
        stop_cluster(shell)
    raw_times, px_times, our_times = times[raw], times[px], times[ours]
    return {
        "n": n,
        "raw_median": statistics.median(raw_times) * 1000,
        "ours_median": statistics.median(our_times) * 1000,
        "px_median": statistics.median(px_times) * 1000,
        "raw_p90": percentile(raw_times, 0.9) * 1000,
        "ours_p90": percentile(our_times, 0.9) * 1000,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4], help="cluster sizes (default: 2 4)")
    parser.add_argument("--cells", type=int, default=100, help="timed cells of each kind (default: 100)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed cells of each kind (default: 5)")
    args = parser.parse_args()
    if args.cells < 1 or args.warmup < 0 or any(n < 1 for n in args.sizes):
        parser.error("--cells and --sizes must be at least 1, --warmup at least 0")
    if args.cells < 50:
        print(f"note: --cells {args.cells} is below the 50 cells a target check needs")

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "ddp_magics")
    results = []
    try:
        for n in args.sizes:
            print(f"n={n}: {args.warmup} warm-up + {args.cells} timed cells of each kind", flush=True)
            results.append(measure(shell, n, args.cells, args.warmup))
    finally:
        stop_cluster(shell)

    print()
    print(
        f"cell latency of {CELL!r}, {args.cells} cells each "
        f"(targets: ours/raw <= {TARGET_RATIO}, ours - %px <= {TARGET_OVER_PX_MS:g} ms)"
    )
    header = (
        f"{'n':>3}  {'raw median ms':>13}  {'%px median ms':>13}  {'ours median ms':>14}  {'ours/raw':>8}  "
        f"{'ours-%px ms':>11}  {'raw p90 ms':>10}  {'ours p90 ms':>11}  targets"
    )
    print(header)
    print("-" * len(header))
    all_pass = True
    for result in results:
        ratio = result["ours_median"] / result["raw_median"]
        over_px = result["ours_median"] - result["px_median"]
        passed = ratio <= TARGET_RATIO and over_px <= TARGET_OVER_PX_MS
        all_pass &= passed
        print(
            f"{result['n']:>3}  {result['raw_median']:>13.2f}  {result['px_median']:>13.2f}  "
            f"{result['ours_median']:>14.2f}  {ratio:>8.2f}  {over_px:>11.2f}  {result['raw_p90']:>10.2f}  "
            f"{result['ours_p90']:>11.2f}  {'PASS' if passed else 'FAIL'}"
        )
    return 0 if all_pass else 1


if __name__ == "__main__":
    sys.exit(main())
