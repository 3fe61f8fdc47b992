"""Files only this user can touch: the state root under the temp directory, files written whole,
Unix sockets inside such directories whatever the length of their path, and their removal.

On a shared machine a predictable path under /tmp belongs to whoever made it first. The state
root is used only once it is shown to be ours: a real directory (not a symlink), owned by this
user, with no access for anyone else. Everything the cluster writes lives below it.

This module runs on both sides and imports neither ipyparallel nor notebook code.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

# sockaddr_un holds 108 bytes with the terminating NUL.
MAX_UNIX_PATH = 107


REMOVE_SECONDS = 2.0  # for a directory to go while a process that writes in it is ending
REMOVE_POLL_SECONDS = 0.02


class UnsafeDirectory(RuntimeError):
    """A directory ddp_magics would use is not private to this user; the message says why."""


def private_root(name: str, parent: Path | None = None) -> Path:
    """``parent/name`` (``parent``: the temp directory), made with mode 0700 if missing, else
    checked to be a real directory of this user's that nobody else can enter or write."""
    parent = Path(tempfile.gettempdir()) if parent is None else parent
    root = parent / name
    with contextlib.suppress(FileExistsError):
        os.mkdir(root, 0o700)
    check_private(root)
    return root


def check_private(directory: Path) -> None:
    """UnsafeDirectory unless ``directory`` is a directory (not a symlink to one) owned by this
    user with no permissions for group or others, in a parent others cannot rename it in."""
    try:
        info = os.lstat(directory)
    except FileNotFoundError:
        raise UnsafeDirectory(f"{directory} vanished while it was being made") from None
    refusal = None
    if stat.S_ISLNK(info.st_mode):
        refusal = f"is a symlink (to {os.readlink(directory)})"
    elif not stat.S_ISDIR(info.st_mode):
        refusal = "is not a directory"
    elif info.st_uid != os.geteuid():
        refusal = f"is owned by uid {info.st_uid}, not by you (uid {os.geteuid()})"
    elif info.st_mode & 0o077:
        refusal = f"has mode {stat.S_IMODE(info.st_mode):04o}: others can reach into it"
    else:
        parent = os.stat(directory.parent)
        others_write = parent.st_mode & stat.S_IWOTH
        if others_write and not parent.st_mode & stat.S_ISVTX and parent.st_uid != os.geteuid():
            refusal = f"lies in {directory.parent}, where anyone may rename it (world-writable, not sticky)"
    if refusal:
        raise UnsafeDirectory(
            f"{directory} {refusal}; ddp_magics keeps its state only in a directory private to you: "
            "remove it, or point TMPDIR somewhere else"
        )


def write_atomically(path: Path, text: str) -> None:
    """``path`` holds ``text`` whole or not at all, for any reader at any time; an existing
    symlink at ``path`` is replaced, never followed."""
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    try:
        with os.fdopen(descriptor, "w") as file:
            file.write(text)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise


@contextlib.contextmanager
def unix_address(path: Path) -> Iterator[str]:
    """An address to bind or connect a Unix socket at ``path``: the path itself, or where it is
    too long for a socket address (a long TMPDIR), the same file reached through
    ``/proc/self/fd`` and a descriptor of its directory, open for the length of the block."""
    if len(os.fsencode(path)) <= MAX_UNIX_PATH:
        yield str(path)
        return
    directory = os.open(path.parent, os.O_PATH | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{directory}/{path.name}"
    finally:
        os.close(directory)


def remove_tree(path: Path, timeout: float = REMOVE_SECONDS) -> bool:
    """Remove the directory ``path`` and all in it, again while something still writes in it
    (``shutil.rmtree`` gives up on a directory that got a new entry while it was being emptied),
    for up to ``timeout`` seconds. Whether it is gone."""
    deadline = time.monotonic() + timeout
    while True:
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.lexists(path):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(REMOVE_POLL_SECONDS)
