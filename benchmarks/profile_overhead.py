"""What ``--profile`` costs on a DDP training step: the same cell with and without it, same
cluster, same run.

One 2-rank gloo cluster. Each repetition runs the DDP cell three times, in an order that rotates
from one repetition to the next: ``%%distributed`` (off), ``%%distributed --profile p`` (on:
torch.profiler on every rank, and the cell traced without values so that its communication is
named), and ``%%distributed`` again (off again, an A/A control). The cell times its own loop of
``--steps`` DDP training steps (3-layer MLP 512 wide, batch 32, 0.5 M parameters); a repetition's
time is the slowest rank's loop. Also printed: the whole cell's wall time (profiler start and
stop, reading the events on the ranks, merging and summarising in the notebook; not drawing).
Prints medians, their ratio and the A/A ratio; no target (the profiler's cost is the profiler's).

    .venv/bin/python benchmarks/profile_overhead.py                 # 21 repetitions
    .venv/bin/python benchmarks/profile_overhead.py --repeats 3     # quick check
"""

from __future__ import annotations

import argparse
import statistics
import time

from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output

SETUP = """\
torch.set_num_threads(1)
import time
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
mlp = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
ddp = DDP(mlp.to(device))
sgd = torch.optim.SGD(ddp.parameters(), lr=0.01)
batch = torch.randn(32, 512, device=device)
"""
LOOP = """\
started = time.perf_counter()
for _ in range({steps}):
    sgd.zero_grad()
    ddp(batch).sum().backward()
    sgd.step()
loop_seconds = time.perf_counter() - started
"""


def run(shell: InteractiveShell, profiled: bool, loop: str) -> tuple[float, float]:
    """(slowest rank's loop seconds, whole cell seconds)."""
    started = time.perf_counter()
    with capture_output():
        shell.run_cell_magic("distributed", "--profile bench_profile" if profiled else "", loop)
    wall = time.perf_counter() - started
    if profiled:
        assert shell.user_ns["bench_profile"].ranks == [0, 1]
    return max(shell.run_line_magic("dist_pull", "loop_seconds").values()), wall


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    loop = LOOP.format(steps=args.steps)
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "ddp_magics")
    kinds = ("off", "on", "off again")
    samples: dict[str, list[tuple[float, float]]] = {kind: [] for kind in kinds}
    try:
        with capture_output() as captured:
            shell.run_line_magic("dist_start", "-n 2 --backend gloo")
        print(captured.stdout.strip())
        with capture_output():
            shell.run_cell_magic("distributed", "", SETUP)
        run(shell, False, loop)  # warm-up
        run(shell, True, loop)
        for repeat in range(args.repeats):
            shift = repeat % len(kinds)
            for kind in kinds[shift:] + kinds[:shift]:
                samples[kind].append(run(shell, kind == "on", loop))
    finally:
        with capture_output():
            shell.run_line_magic("dist_stop", "")

    print(f"{args.steps} DDP training steps (MLP 512 wide, batch 32) on 2 ranks, {args.repeats} repetitions")
    print(f"{'':22}{'off':>12}{'--profile':>12}{'ratio':>8}{'off again':>12}{'A/A':>7}")
    for label, index in (("loop (slowest rank)", 0), ("whole cell", 1)):
        off, on, again = (statistics.median(s[index] for s in samples[kind]) for kind in kinds)
        times = f"{off * 1e3:10.1f}ms{on * 1e3:10.1f}ms{on / off:8.2f}{again * 1e3:10.1f}ms"
        print(f"{label:22}{times}{again / off:7.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
