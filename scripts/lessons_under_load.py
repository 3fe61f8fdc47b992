"""Run lessons under strict nbval while every core is kept busy, several rounds, and say which passed.

    .venv/bin/python scripts/lessons_under_load.py 00 10 12 13            # 3 rounds, one busy loop per core
    .venv/bin/python scripts/lessons_under_load.py 13 --rounds 5 --busy 4
    .venv/bin/python scripts/lessons_under_load.py notebooks/12_debugging.ipynb --busy 0   # no load

Each round runs the chosen lessons one after another, each with the Makefile's flags
(``-p no:cacheprovider --nbval --nbval-current-env --nbval-cell-timeout=120``). Meanwhile ``--busy N`` Python
processes (default: one per core) spin in a loop, so the ranks, the kernel and the launchers a lesson starts
compete for the CPU as on a loaded CI machine. The script starts the busy loops itself and stops them by PID
when it ends, however it ends; a busy loop also stops on its own if this script dies (it watches its parent).

One line per lesson per round (pass/fail and seconds), then a table; a failed run's pytest output is kept in
``--log-dir`` (default ``test-artifacts/lessons_under_load``). Exit status 1 if any run failed.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
NBVAL_ARGS = ["-p", "no:cacheprovider", "--nbval", "--nbval-current-env", "--nbval-cell-timeout=120"]
# Spins until stopped, checking now and then that the script that started it is still its parent.
BUSY_LOOP = """
import os, sys
parent = int(sys.argv[1])
while os.getppid() == parent:
    for _ in range(200_000):
        pass
"""


def lesson_path(name: str) -> Path:
    """A notebook path as given, or the lesson of that number (``0``, ``00``, ``13``)."""
    path = Path(name)
    if path.suffix == ".ipynb":
        if not path.exists():
            sys.exit(f"no such notebook: {name}")
        return path.resolve()
    if not name.isdigit():
        sys.exit(f"not a lesson number or a notebook: {name}")
    found = sorted(NOTEBOOKS.glob(f"{int(name):02d}_*.ipynb"))
    if len(found) != 1:
        sys.exit(f"lesson {name}: {len(found)} notebooks {int(name):02d}_*.ipynb in {NOTEBOOKS}, not one")
    return found[0]


def start_busy(count: int) -> list[subprocess.Popen]:
    return [
        subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(os.getpid())], stdin=subprocess.DEVNULL)
        for _ in range(count)
    ]


def stop(processes: list[subprocess.Popen]) -> None:
    """Kill each process we started, by its PID, and reap it."""
    for process in processes:
        if process.poll() is None:
            process.kill()
    for process in processes:
        process.wait()


def end(process: subprocess.Popen) -> str:
    """Ask a pytest run to stop (SIGINT: it shuts its kernel down); kill its process group if it does not."""
    process.send_signal(signal.SIGINT)
    try:
        output, _ = process.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the group it leads: pytest, its kernel, what they started
        output, _ = process.communicate()
    return output or ""


def run_nbval(path: Path, timeout: float) -> tuple[bool, float, str]:
    """(passed, seconds, pytest's output) of one strict nbval run of ``path``."""
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    start = time.monotonic()
    # In a session of its own, so that a run that must be stopped goes with its kernel and ranks.
    process = subprocess.Popen(
        [sys.executable, "-m", "pytest", *NBVAL_ARGS, str(shown)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        output = end(process) + f"\n[lessons_under_load] stopped after the {timeout:.0f} s limit\n"
    except BaseException:  # ^C or SIGTERM: stop the run too
        end(process)
        raise
    return process.returncode == 0, time.monotonic() - start, output


def failures(output: str) -> list[str]:
    """pytest's ``FAILED ...`` lines (without colours), or its last line."""
    plain = re.sub(r"\x1b\[[0-9;]*m", "", output)
    lines = [line for line in plain.splitlines() if line.startswith(("FAILED", "ERROR"))]
    return lines or plain.strip().splitlines()[-1:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("lessons", nargs="+", help="lesson numbers (00, 13) or notebook paths")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each lesson (default 3)")
    parser.add_argument(
        "--busy",
        type=int,
        default=os.cpu_count() or 1,
        help="busy-loop processes kept running meanwhile (default: one per core)",
    )
    parser.add_argument("--timeout", type=float, default=900, help="seconds one nbval run may take")
    parser.add_argument(
        "--log-dir",
        type=Path,
        default=ROOT / "test-artifacts" / "lessons_under_load",
        help="where a failed run's pytest output is kept",
    )
    args = parser.parse_args()
    paths = [lesson_path(name) for name in args.lessons]
    # ^C and kill end the runs through the finally below. Started in the background, a process inherits SIGINT
    # ignored, and so would the pytest runs it starts: a handler of its own gives them the default back.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda number, frame: sys.exit(128 + number))

    results: dict[tuple[Path, int], tuple[bool, float]] = {}
    print(
        f"{len(paths)} lessons x {args.rounds} rounds, strict nbval, {args.busy} busy loops on "
        f"{os.cpu_count()} cores",
        flush=True,
    )
    busy = start_busy(args.busy)
    try:
        for round_ in range(1, args.rounds + 1):
            for path in paths:
                passed, seconds, output = run_nbval(path, args.timeout)
                results[path, round_] = passed, seconds
                verdict = "pass" if passed else "FAIL"
                print(f"round {round_}/{args.rounds}  {path.name:38} {verdict}  {seconds:6.1f} s", flush=True)
                if not passed:
                    args.log_dir.mkdir(parents=True, exist_ok=True)
                    log = args.log_dir / f"{path.stem}-round{round_}.log"
                    log.write_text(output)
                    for line in failures(output):
                        print(f"    {line}")
                    print(f"    pytest's output: {log}", flush=True)
    finally:
        stop(busy)

    print()
    print(f"{'lesson':38} " + "  ".join(f"{f'round {r}':>12}" for r in range(1, args.rounds + 1)))
    for path in paths:
        cells = []
        for round_ in range(1, args.rounds + 1):
            passed, seconds = results[path, round_]
            cells.append(f"{'pass' if passed else 'FAIL'} {seconds:5.1f} s")
        print(f"{path.name:38} " + "  ".join(f"{cell:>12}" for cell in cells))
    failed = sum(not passed for passed, _ in results.values())
    print(
        f"\n{len(results) - failed} of {len(results)} runs passed under load"
        + (f", {failed} failed" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
