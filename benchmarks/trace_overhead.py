"""What tracing costs: 100 x 1 MB ``all_reduce``, and 20 DDP training steps, with tracing off
and on, same cluster, same run.

One 2-rank gloo cluster (``%dist_start -n 2 --backend gloo``). Each repetition runs the same cell
three times, in an order that rotates from one repetition to the next:

  off:       ``%%distributed``            (nothing is registered)
  on:        ``%%distributed --trace t``  (every call recorded, events collected into a Trace)
  off again: ``%%distributed``            (an A/A control: how far two runs of the same cell
                                           differ on this machine, printed beside the ratio)

The cell times its own loop of 100 ``dist.all_reduce`` calls on a 1 MB float32 tensor
(262 144 elements); a repetition's time is the slowest rank's. The DDP cell times 20 training
steps (forward, backward, SGD step) of a 3-layer MLP (512 wide, batch 32, 0.5 M parameters:
two gradient buckets, DDP's first holding at most 1 MB), whose all-reduces are traced from the
dispatcher, not from torch.distributed's functions. Also printed: the whole-cell wall time
(the magic's own work included: starting the trace, reading and matching 200 events) and the
CPU time of the busiest rank's loop (what tracing adds to the ranks' work, little affected by
other processes on a busy machine).

Targets: median(on) / median(off) <= 1.05 for the all_reduce loop, <= 1.10 for the DDP steps.
Exits 1 if one is missed. Beside each ratio, its 90 % bootstrap interval (repetitions resampled
whole): on this 2-core machine a loop's time varies by about 20 % from one run to the next (the two
ranks' gloo threads busy-poll their sockets and take turns on the cores), so the interval says how
far the ratio itself can be trusted.

    .venv/bin/python benchmarks/trace_overhead.py                 # 101 repetitions
    .venv/bin/python benchmarks/trace_overhead.py --repeats 3     # quick check
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output

CALLS = 100
ELEMENTS = 262_144  # 1 MB of float32
TARGET_RATIO = 1.05
DDP_TARGET_RATIO = 1.10
DDP_STEPS = 20
BOOTSTRAP_SAMPLES = 2000
SETUP = f"""\
torch.set_num_threads(1)
big = torch.ones({ELEMENTS}, device=device)
import time
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
mlp = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
ddp = DDP(mlp.to(device))
sgd = torch.optim.SGD(ddp.parameters(), lr=0.01)
batch = torch.randn(32, 512, device=device)
"""
LOOP = f"""\
started, cpu_started = time.perf_counter(), time.process_time()
for _ in range({CALLS}):
    dist.all_reduce(big)
loop_seconds = (time.perf_counter() - started, time.process_time() - cpu_started)
"""
DDP_LOOP = f"""\
started, cpu_started = time.perf_counter(), time.process_time()
for _ in range({DDP_STEPS}):
    sgd.zero_grad()
    ddp(batch).sum().backward()
    sgd.step()
loop_seconds = (time.perf_counter() - started, time.process_time() - cpu_started)
"""


def run(
    shell: InteractiveShell, traced: bool, loop: str = LOOP, calls: int = CALLS
) -> tuple[float, float, float]:
    """(slowest rank's loop seconds, whole cell seconds, most CPU seconds a rank's loop used)."""
    started = time.perf_counter()
    with capture_output():
        shell.run_cell_magic("distributed", "--trace bench_trace" if traced else "", loop)
    wall = time.perf_counter() - started
    if traced:
        trace = shell.user_ns["bench_trace"]
        # Every call of both ranks recorded (DDP: one all_reduce per bucket, two buckets).
        assert trace.calls() in (2 * calls, 4 * calls) and not trace.mismatches, trace.summary()
    loops = shell.run_line_magic("dist_pull", "loop_seconds").values()
    return max(loop for loop, _ in loops), wall, max(cpu for _, cpu in loops)


def bootstrap_interval(on: list[float], off: list[float]) -> tuple[float, float]:
    """The 90 % bootstrap interval of median(on) / median(off). Repetitions are resampled whole
    (both kinds' samples of a repetition together), as they were taken side by side."""
    rng = random.Random(0)
    count = len(on)
    ratios = []
    for _ in range(BOOTSTRAP_SAMPLES):
        picks = [rng.randrange(count) for _ in range(count)]
        ratios.append(statistics.median(on[i] for i in picks) / statistics.median(off[i] for i in picks))
    ratios.sort()
    return ratios[int(0.05 * BOOTSTRAP_SAMPLES)], ratios[int(0.95 * BOOTSTRAP_SAMPLES) - 1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=101)
    args = parser.parse_args()

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "ddp_magics")
    try:
        with capture_output() as captured:
            shell.run_line_magic("dist_start", "-n 2 --backend gloo")
        print(captured.stdout.strip())
        with capture_output():
            shell.run_cell_magic("distributed", "", SETUP)
        run(shell, traced=False)  # warm-up
        run(shell, traced=True)
        run(shell, traced=False, loop=DDP_LOOP, calls=DDP_STEPS)
        # "off" twice: the second (A/A) shows how far two runs of the same cell differ here.
        kinds = ("off", "on", "off again")
        samples: dict[str, list[tuple[float, float, float]]] = {kind: [] for kind in kinds}
        ddp_samples: dict[str, list[tuple[float, float, float]]] = {kind: [] for kind in kinds}
        for repeat in range(args.repeats):
            shift = repeat % len(kinds)  # each kind in each place of the order, in turn
            order = kinds[shift:] + kinds[:shift]
            for kind in order:
                samples[kind].append(run(shell, kind == "on"))
            for kind in reversed(order):
                ddp_samples[kind].append(run(shell, kind == "on", DDP_LOOP, DDP_STEPS))
    finally:
        with capture_output():
            shell.run_line_magic("dist_stop", "")

    failed = False
    for title, measured, target in (
        (f"{CALLS} x all_reduce of {ELEMENTS * 4 / 1e6:.2f} MB", samples, TARGET_RATIO),
        (f"{DDP_STEPS} DDP training steps (MLP 512 wide, batch 32)", ddp_samples, DDP_TARGET_RATIO),
    ):

        def values(kind: str, index: int) -> list[float]:
            return [sample[index] for sample in measured[kind]]  # noqa: B023

        print(f"{title} on 2 ranks, {args.repeats} repetitions each")
        print(
            f"{'':24}{'tracing off':>14}{'tracing on':>14}{'ratio':>8}{'90 % interval':>16}"
            f"{'off again':>14}{'A/A ratio':>10}{'90 % interval':>16}"
        )
        for label, index in (("loop (slowest rank)", 0), ("whole cell", 1), ("loop CPU (busiest rank)", 2)):
            off, on, again = (values(kind, index) for kind in kinds)
            low, high = bootstrap_interval(on, off)
            aa_low, aa_high = bootstrap_interval(again, off)
            off_ms, on_ms, again_ms = (statistics.median(v) * 1e3 for v in (off, on, again))
            interval, aa_interval = f"{low:.3f}-{high:.3f}", f"{aa_low:.3f}-{aa_high:.3f}"
            print(
                f"{label:24}{off_ms:>11.1f} ms{on_ms:>11.1f} ms{on_ms / off_ms:>8.3f}{interval:>16}"
                f"{again_ms:>11.1f} ms{again_ms / off_ms:>10.3f}{aa_interval:>16}"
            )
        ratio = statistics.median(values("on", 0)) / statistics.median(values("off", 0))
        verdict = "pass" if ratio <= target else "FAIL"
        failed |= ratio > target
        print(f"target: loop ratio <= {target}: {verdict}\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
