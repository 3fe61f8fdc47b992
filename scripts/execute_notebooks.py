"""Re-execute the lessons in place: ``make notebooks`` (or name notebooks as arguments).

Each notebook runs top to bottom in a fresh ``python3`` kernel with the notebook's folder as the
working directory, and is written back with its new outputs, without execution timestamps or
widget state (``--strip-only``: only remove those, running nothing). Run it with the venv's python: the
``python3`` kernel spec must start that same python, so the lessons use the pinned packages.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import nbformat
from jupyter_client.kernelspec import KernelSpecManager
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
KERNEL_NAME = "python3"
CELL_TIMEOUT = 120
# jupyter_client runs sys.executable for a kernel spec whose argv starts with one of these names.
PYTHON_NAMES = {"python", f"python{sys.version_info[0]}", "python{}.{}".format(*sys.version_info[:2])}


def kernel_python() -> str:
    """The python the ``python3`` kernel spec starts; exits if it is not this environment's."""
    spec = KernelSpecManager().get_kernel_spec(KERNEL_NAME)
    program = spec.argv[0]
    if program in PYTHON_NAMES:
        return sys.executable
    prefix = os.path.abspath(sys.prefix)
    if os.path.commonpath([os.path.abspath(program), prefix]) != prefix:
        sys.exit(
            f"kernel spec {KERNEL_NAME!r} ({spec.resource_dir}) runs {program}, not the python of "
            f"{prefix}; run `make install` to install the venv's kernel spec"
        )
    return program


def notebooks(arguments: list[str]) -> list[Path]:
    if arguments:
        return [Path(argument).resolve() for argument in arguments]
    return sorted(path for path in NOTEBOOKS.rglob("*.ipynb") if ".ipynb_checkpoints" not in path.parts)


def execute(path: Path) -> None:
    """Run every cell of ``path`` and write the notebook back with the new outputs."""
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(
        notebook,
        kernel_name=KERNEL_NAME,
        timeout=CELL_TIMEOUT,
        resources={"metadata": {"path": str(path.parent)}},
    )
    client.execute()
    nbformat.write(strip_volatile(notebook), path)


def strip_volatile(notebook):
    """Drop what changes at every run and says nothing about the lesson: each cell's execution
    timestamps and the saved state of widgets (the live view's, the ring stepper's: run the cell
    to see a widget). tests/test_notebook_hygiene.py fails if they come back."""
    for cell in notebook.cells:
        cell.metadata.pop("execution", None)
    notebook.metadata.pop("widgets", None)
    return notebook


def main(arguments: list[str]) -> int:
    strip_only = "--strip-only" in arguments
    paths = notebooks([argument for argument in arguments if argument != "--strip-only"])
    if strip_only:
        for path in paths:
            nbformat.write(strip_volatile(nbformat.read(path, as_version=4)), path)
        return 0
    if not paths:
        print(f"no notebooks under {NOTEBOOKS.relative_to(ROOT)}/")
        return 0
    print(f"kernel {KERNEL_NAME}: {kernel_python()}")
    for path in paths:
        print(f"executing {os.path.relpath(path)}", flush=True)
        execute(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
