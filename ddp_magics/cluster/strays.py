"""Where a user's clusters live, who owns each, and removing those whose kernel is gone.

Every cluster has a private directory under :func:`clusters_root` with an owner file naming the
kernel that started it (:class:`~ddp_magics.lifetime.Owner`) and its host's name.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

from ddp_magics.cluster.stopping import stop_processes
from ddp_magics.lifetime import Owner, cluster_processes
from ddp_magics.private_files import UnsafeDirectory, private_root, remove_tree, write_atomically
from ddp_magics.shared_memory import segments_removed_after

CLUSTERS_ROOT_NAME = f"ddp_magics-{os.geteuid()}"  # under the temp directory, private to this user
OWNER_FILE = "owner"  # the kernel that started the cluster (lifetime.Owner), and its host's name
# A cluster directory without its owner file is being made, or being removed, for this long at most.
HALF_MADE_SECONDS = 60


def clusters_root() -> Path:
    """The directory of this user's clusters; UnsafeDirectory if it is not private to this user."""
    return private_root(CLUSTERS_ROOT_NAME)


def this_host() -> str:
    return socket.gethostname()


def write_owner(workdir: Path) -> None:
    write_atomically(workdir / OWNER_FILE, f"{Owner.this_process()}\n{this_host()}\n")


def stop_stray_clusters() -> list[str]:
    """Remove the clusters whose owning kernel is gone.

    Their processes normally ended with their owner (see :mod:`ddp_magics.lifetime`); any
    still running (started by an older version, or stuck) are stopped by PID. A cluster of a
    kernel on another machine (a temp directory shared over the network) is left alone.
    Returns one line per cluster that needed more than removing its files: what was stopped,
    or why it could not be cleaned up. Never raises; a clusters' directory that is not this
    user's own holds nothing of this user's to clean (and starting a cluster refuses it).
    """
    try:
        root = clusters_root()
    except UnsafeDirectory:
        return []
    reports = []
    for workdir in sorted(root.glob("cluster-*")):
        if workdir.is_symlink() or not workdir.is_dir():
            continue  # never made by ddp_magics, which makes directories only
        try:
            reports.extend(_remove_if_orphaned(workdir))
        except OSError as error:
            reports.append(f"could not clean up {workdir}: {error}")
    return reports


def _remove_if_orphaned(workdir: Path) -> list[str]:
    try:
        owner_line, _, host = (workdir / OWNER_FILE).read_text().partition("\n")
        owner = Owner.parse(owner_line)
    except FileNotFoundError:
        if time.time() - workdir.stat().st_mtime < HALF_MADE_SECONDS:
            return []  # being created by another kernel right now, or being removed by its controller
        owner = None  # its removal was cut short
    except ValueError:
        owner = None  # written by an older version of ddp_magics
    if owner is not None:
        if not owner.on_this_machine and host.strip() != this_host():
            return []  # another machine's kernel, which alone can tell whether it still runs
        if owner.alive():
            return []
    reports = []
    processes = cluster_processes(workdir)
    if processes:
        with segments_removed_after(process.pid for process in processes):
            stop_processes(processes, grace=0)
        reports.append(f"stopped {len(processes)} processes of {workdir.name}, whose kernel had ended")
    if not remove_tree(workdir):
        reports.append(f"could not remove {workdir}")
    return reports
