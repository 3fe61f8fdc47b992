"""Execute lessons into copies and list each code cell whose text output differs from the committed one.

Made for the GPU run (scripts/gpu_check.sh): the lessons' committed outputs come from CPU runs, so a
difference on a GPU machine is either the expected device name or a bug. Each notebook runs top to
bottom in a fresh ``python3`` kernel with ``notebooks/`` as its working directory, as
scripts/execute_notebooks.py runs it, but the executed notebook goes to ``--out`` and the committed
file is never written. A cell that raises where it is not tagged ``raises-exception`` is reported
as the lesson's failure and execution goes on (later differences may follow from it); a lesson that
runs past ``--budget`` seconds stops between cells.

What is compared, per code cell: the text a reader sees, in order (stream text, ``text/plain`` of
results and displays, ``ename: evalue`` of errors). Cells tagged ``nbval-ignore-output`` (timings)
are listed as ignored. Images are not compared.

    python scripts/gpu_lessons.py notebooks/00_start_here.ipynb --out /tmp/lessons
    # writes /tmp/lessons/00_start_here.ipynb (executed) and /tmp/lessons/00_start_here.txt (report)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError

IGNORE_TAG = "nbval-ignore-output"
SHOWN_LINES = 6  # of each side of a difference
# Run after the lesson's cells so that no cluster outlives the kernel, whatever the lesson left.
CLEANUP = """\
ip = get_ipython()
if 'ddp_magics' in ip.extension_manager.loaded:
    try:
        ip.run_line_magic('dist_stop', '')
    except Exception:
        pass
"""


def shown_lines(cell) -> list[str]:
    """The text of a code cell's outputs, in order, as lines."""
    parts = []
    for output in cell.get("outputs", []):
        kind = output.get("output_type")
        if kind == "stream":
            parts.append(output.get("text", ""))
        elif kind in ("execute_result", "display_data"):
            text = output.get("data", {}).get("text/plain", "")
            if isinstance(text, list):
                text = "".join(text)
            if text:
                parts.append(text if text.endswith("\n") else text + "\n")
        elif kind == "error":
            parts.append(f"{output.get('ename')}: {output.get('evalue')}\n")
    return "".join(parts).splitlines()


def difference(committed: list[str], now: list[str]) -> list[str]:
    """The first differing lines of both, indented, or [] when equal."""
    if committed == now:
        return []
    first = next((i for i, (a, b) in enumerate(zip(committed, now)) if a != b), min(len(committed), len(now)))
    lines = [f"    from line {first + 1} ({len(committed)} lines committed, {len(now)} now):"]
    for label, side in (("cpu", committed), ("gpu", now)):
        shown = side[first : first + SHOWN_LINES] or ["<nothing>"]
        lines += [f"    {label}| {line}" for line in shown]
        if len(side) > first + SHOWN_LINES:
            lines.append(f"    {label}| ... ({len(side) - first - SHOWN_LINES} more)")
    return lines


def compare(committed_nb, executed_nb, reached: int) -> tuple[list[str], dict[str, int]]:
    """Report lines for each code cell up to index ``reached`` (exclusive), and the counts."""
    lines: list[str] = []
    counts = {"same": 0, "ignored": 0, "differs": 0, "not run": 0}
    code_number = 0
    for index, (old, new) in enumerate(zip(committed_nb.cells, executed_nb.cells)):
        if old.cell_type != "code":
            continue
        code_number += 1
        where = f"cell {index} (code cell {code_number})"
        if index >= reached:
            counts["not run"] += 1
            continue
        if IGNORE_TAG in old.metadata.get("tags", []):
            counts["ignored"] += 1
            lines.append(f"  {where}: ignored ({IGNORE_TAG})")
            continue
        diff = difference(shown_lines(old), shown_lines(new))
        if diff:
            counts["differs"] += 1
            first_source = next((s for s in old.source.splitlines() if s.strip()), "")
            lines.append(f"  {where} differs; its first line: {first_source[:100]}")
            lines += diff
        else:
            counts["same"] += 1
    return lines, counts


def run_lesson(path: Path, out: Path, cell_timeout: float, budget: float) -> str:
    """Execute ``path`` into ``out``; the lesson's report."""
    committed = nbformat.read(path, as_version=4)
    notebook = nbformat.read(path, as_version=4)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    client = NotebookClient(
        notebook,
        kernel_name="python3",
        timeout=int(cell_timeout),
        resources={"metadata": {"path": str(path.resolve().parent)}},
    )
    started = time.monotonic()
    failures: list[str] = []
    reached = len(notebook.cells)
    executed = 0
    try:
        with client.setup_kernel():
            for index, cell in enumerate(notebook.cells):
                left = budget - (time.monotonic() - started)
                if left <= 0:
                    reached = index
                    failures.append(f"stopped before cell {index}: the lesson's {budget:.0f} s ran out")
                    break
                if cell.cell_type != "code":
                    continue
                client.timeout = int(max(10, min(cell_timeout, left)))
                try:
                    executed += 1
                    client.execute_cell(cell, index, execution_count=executed)
                except CellTimeoutError:
                    failures.append(f"cell {index} timed out after {client.timeout:.0f} s")
                except CellExecutionError as error:
                    errors = [o for o in cell.outputs if o.get("output_type") == "error"]
                    said = f"{errors[-1].ename}: {errors[-1].evalue}" if errors else str(error)[-300:]
                    failures.append(f"cell {index} raised {said}")
            try:
                client.timeout = 60
                notebook.cells.append(nbformat.v4.new_code_cell(CLEANUP))
                client.execute_cell(notebook.cells[-1], len(notebook.cells) - 1)
            except Exception as error:
                failures.append(f"the clean-up cell failed: {type(error).__name__}: {error}"[:300])
    except Exception as error:  # the kernel did not start or died
        failures.append(f"execution ended: {type(error).__name__}: {error}"[:500])
        ran = [i for i, cell in enumerate(notebook.cells) if cell.get("outputs")]
        reached = min(reached, max(ran, default=-1) + 1)
    seconds = time.monotonic() - started
    if notebook.cells and notebook.cells[-1].source == CLEANUP:
        notebook.cells.pop()
    nbformat.write(notebook, out / path.name)
    lines, counts = compare(committed, notebook, reached)
    verdict = "executed ok" if not failures else "FAILED: " + "; ".join(failures)
    summary = ", ".join(f"{count} {name}" for name, count in counts.items() if count)
    head = f"== {path.stem}: {verdict} ({seconds:.0f} s; code cells: {summary})"
    if not counts["differs"] and not failures:
        head += " - no difference"
    return "\n".join([head, *lines]) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True, help="folder for executed copies and reports")
    parser.add_argument("--cell-timeout", type=float, default=180)
    parser.add_argument("--budget", type=float, default=150, help="seconds a lesson may run")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for path in args.notebooks:
        report = run_lesson(path, args.out, args.cell_timeout, args.budget)
        (args.out / f"{path.stem}.txt").write_text(report)
        print(report, end="", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
