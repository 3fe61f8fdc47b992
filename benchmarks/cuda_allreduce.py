"""all_reduce on CUDA tensors through the magics' ranks, against the GPU's device-to-device copy, same run.

One GPU allows two kinds of rank group: two gloo ranks sharing it (gloo stages CUDA tensors through
host memory and moves them over TCP on this host), and NCCL at world size 1 (NCCL refuses two
ranks of one communicator on one GPU; a one-rank all_reduce in place moves nothing, so only its
time per call means anything). The reference is the GPU's own memory-copy bandwidth, measured in
this process before the ranks start: ``dst.copy_(src)`` of the same sizes, timed with CUDA events.

  copy GB/s = S / t (bytes copied; read + written is twice that)
  algbw = S / t        busbw = algbw * 2(n-1)/n        (the nccl-tests definitions)

Each all_reduce call is timed on every rank (a barrier before it, ``torch.cuda.synchronize()``
after it) and counted at the slowest rank; every figure is the median over the calls. The gloo
rows on CPU tensors show what the staging through host memory costs. Without CUDA it says so and
measures only those CPU rows, at one small size.

    python benchmarks/cuda_allreduce.py                # 1, 16, 128 MiB, 10 calls each
    python benchmarks/cuda_allreduce.py --quick        # 1 MiB, 3 calls
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output

RANK_CODE = """\
import time

def allreduce_seconds(numel, on, repeats):
    t = torch.ones(numel, device=on)
    for _ in range(2):
        dist.all_reduce(t)
    if t.is_cuda:
        torch.cuda.synchronize()
    seconds = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(t)
        if t.is_cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    del t
    return seconds
"""


def copy_seconds(size_bytes: int, repeats: int) -> float:
    """Median seconds of one device-to-device copy of ``size_bytes`` (CUDA events)."""
    src = torch.ones(size_bytes // 4, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return statistics.median(samples)


def allreduce_seconds(shell: InteractiveShell, size_bytes: int, on: str, repeats: int) -> float:
    """Median over ``repeats`` calls of the slowest rank's seconds for one all_reduce."""
    with capture_output():
        shell.run_cell_magic(
            "distributed", "", f"seconds = allreduce_seconds({size_bytes // 4}, {on!r}, {repeats})"
        )
    per_rank = shell.run_line_magic("dist_pull", "seconds")
    return statistics.median(max(calls) for calls in zip(*per_rank.values()))


def measure_ranks(shell, start: str, sizes: list[int], places: list[str], repeats: int) -> dict:
    """Start ranks with ``start``'s arguments, time all_reduce for each size and place, stop them."""
    found = {}
    with capture_output() as captured:
        shell.run_line_magic("dist_start", start)
    print(captured.stdout.strip())
    try:
        with capture_output():
            shell.run_cell_magic("distributed", "", RANK_CODE)
        for size in sizes:
            for on in places:
                found[size, on] = allreduce_seconds(shell, size, on, repeats)
    finally:
        with capture_output():
            shell.run_line_magic("dist_stop", "")
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 MiB, 3 calls")
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 16, 128])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    sizes_mib = [1] if args.quick else args.sizes_mib
    repeats = 3 if args.quick else args.repeats
    sizes = [mib << 20 for mib in sizes_mib]
    cuda = torch.cuda.is_available()

    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}")
    if not cuda:
        print("no CUDA: no reference copy, no CUDA all_reduce; gloo on CPU tensors only, at 1 MiB")
        sizes, repeats = [1 << 20], 3
    else:
        print(f"device: {torch.cuda.get_device_name()}")
    reference = {size: copy_seconds(size, 20) for size in sizes} if cuda else {}

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "ddp_magics")
    gloo = measure_ranks(shell, "-n 2 --backend gloo", sizes, ["cuda", "cpu"] if cuda else ["cpu"], repeats)
    nccl = measure_ranks(shell, "-n 1 --backend nccl", sizes, ["cuda"], repeats) if cuda else {}

    def busbw(seconds: float, size: int, ranks: int) -> float:
        return size / seconds / 1e9 * 2 * (ranks - 1) / ranks

    print(f"\nmedians of {repeats} all_reduce calls (slowest rank); reference: median of 20 copies")
    header = f"{'size':>8}  {'ranks':24}{'time ms':>9}{'busbw GB/s':>12}{'copy GB/s':>11}{'ratio':>9}"
    print(header)
    for size in sizes:
        copy = size / reference[size] / 1e9 if cuda else None
        rows = [("2 gloo, CUDA tensors", gloo.get((size, "cuda")), 2)] if cuda else []
        rows += [("2 gloo, CPU tensors", gloo[size, "cpu"], 2)]
        rows += [("1 nccl, CUDA tensors", nccl.get((size, "cuda")), 1)] if cuda else []
        for label, seconds, ranks in rows:
            bus = busbw(seconds, size, ranks)
            copy_text = f"{copy:>11.1f}" if copy else f"{'-':>11}"
            ratio = f"{bus / copy:>9.4f}" if copy and ranks > 1 else f"{'-':>9}"
            print(f"{size >> 20:>4} MiB  {label:24}{seconds * 1e3:>9.3f}{bus:>12.2f}{copy_text}{ratio}")
    if cuda:
        print("ratio: busbw / copy GB/s. NCCL at world size 1: busbw is 0 by definition (2(n-1)/n = 0);")
        print("its time is the cost of a call that moves nothing.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
