"""breakpoint() on a rank: from typing ``c`` at its prompt to the cell finishing, against the
same cell without a breakpoint, both in one real kernel with 4 gloo ranks, alternated.

  reference:  a cell whose ranks each all_reduce a tensor and print it, from sending it to its
              reply;
  continue:   the same cell with ``breakpoint()`` on rank 1 before the all_reduce, from the
              front end answering the ``(Pdb rank 1)`` prompt with ``c`` to the cell's reply.

Prints medians of the rounds (default 5) and their ratio.

    .venv/bin/python benchmarks/debugger.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from jupyter_client.manager import start_new_kernel

PLAIN = "%%distributed\nt = torch.ones(1)\ndist.all_reduce(t)\nprint(rank, t.item())"
STOPPED = PLAIN.replace("%%distributed\n", "%%distributed\nif rank == 1:\n    breakpoint()\n")


def time_plain(client) -> float:
    started = time.perf_counter()
    reply = client.execute_interactive(PLAIN, timeout=60, output_hook=lambda message: None)
    elapsed = time.perf_counter() - started
    if reply["content"]["status"] != "ok":
        raise RuntimeError(f"the cell failed: {reply['content']}")
    return elapsed


def time_continue(client) -> float:
    answered = []

    def answer(message):
        answered.append(time.perf_counter())
        client.input("c")

    reply = client.execute_interactive(
        STOPPED, timeout=60, allow_stdin=True, stdin_hook=answer, output_hook=lambda message: None
    )
    elapsed = time.perf_counter() - answered[0]
    if reply["content"]["status"] != "ok" or len(answered) != 1:
        raise RuntimeError(f"the cell failed or prompted {len(answered)} times: {reply['content']}")
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    manager, client = start_new_kernel(kernel_name="python3")
    try:
        reply = client.execute_interactive(
            "%load_ext ddp_magics\n%dist_start -n 4 --backend gloo", timeout=120
        )
        if reply["content"]["status"] != "ok":
            raise RuntimeError("the cluster did not start")
        time_plain(client)  # first cells pay one-time costs
        time_continue(client)
        plain, resumed = [], []
        for round_number in range(args.rounds):
            order = [(plain, time_plain), (resumed, time_continue)]
            for times, measure in order if round_number % 2 == 0 else order[::-1]:
                times.append(measure(client))
            print(
                f"round {round_number + 1}/{args.rounds}: "
                f"plain {plain[-1]:.3f} s, after c {resumed[-1]:.3f} s"
            )
        client.execute_interactive("%dist_stop", timeout=60)
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    reference, ours = statistics.median(plain), statistics.median(resumed)
    print(f"\nn = 4, medians of {args.rounds} rounds")
    print(f"  cell without a breakpoint (reference)  {reference:.3f} s")
    print(f"  from typing c to the cell's end        {ours:.3f} s  x{ours / reference:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
