"""Run over ssh on each host of a multi-host cluster before its engines start:

    python -m ddp_magics.engine.host NAME

makes (or checks) this user's private state root in the host's temp directory, removes what
clusters of ended kernels left there, makes the directory ``NAME`` for this cluster's engines
(their ipyparallel profile, logs and IPython directory), and prints one JSON line: that
directory and the host's GPU count. A state root that is not private to this user is refused
with one line on stderr and exit status 1.

Engines on another host cannot watch the kernel's PID; they exit when its lifeline closes,
leaving their directory behind if the kernel's machine vanished. Such a directory is removed
here at the next start on this host: it is one of these host directories, no process of this
host belongs to it (by the cluster directory in its environment), and it is older than a
start can take (so a cluster starting right now from another kernel keeps its own).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import psutil

from ddp_magics.lifetime import CLUSTER_DIR_ENV
from ddp_magics.private_files import UnsafeDirectory, private_root

ROOT_NAME = f"ddp_magics-{os.geteuid()}"
# Host directories are named apart from a kernel's own cluster directories (``cluster-*``),
# which may share the temp directory when the kernel's machine is one of the hosts.
HOST_DIR_PREFIX = "host-"
STARTING_SECONDS = 120


def prepare(name: str) -> dict:
    root = private_root(ROOT_NAME)
    removed = remove_leftovers(root)
    workdir = root / f"{HOST_DIR_PREFIX}{name}"
    workdir.mkdir(mode=0o700)
    (workdir / "profile" / "log").mkdir(parents=True)  # the engines' profile, where they log
    return {"workdir": str(workdir), "gpus": _gpu_count(), "removed": removed}


def remove_leftovers(root: Path) -> list[str]:
    """The host directories in ``root`` that no running process of this host belongs to."""
    candidates = [
        path
        for path in root.glob(f"{HOST_DIR_PREFIX}*")
        if path.is_dir() and not path.is_symlink() and time.time() - path.stat().st_mtime > STARTING_SECONDS
    ]
    if not candidates:
        return []
    in_use = _directories_in_use()
    removed = []
    for path in candidates:
        if str(path) not in in_use:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path.name)
    return removed


def _directories_in_use() -> set[str]:
    """The cluster directories named in the environment of this user's processes."""
    in_use = set()
    for process in psutil.process_iter(["uids"]):
        try:
            if process.info["uids"] is None or process.info["uids"].real != os.getuid():
                continue
            directory = process.environ().get(CLUSTER_DIR_ENV)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if directory:
            in_use.add(directory)
    return in_use


def _gpu_count() -> int:
    return len(list(Path("/dev").glob("nvidia[0-9]*")))


def main() -> None:
    name = sys.argv[1]
    if not name or "/" in name or name.startswith("."):
        sys.exit(f"not a cluster name: {name!r}")
    try:
        print(json.dumps(prepare(name)), flush=True)
    except UnsafeDirectory as error:
        sys.exit(str(error))


if __name__ == "__main__":
    main()
