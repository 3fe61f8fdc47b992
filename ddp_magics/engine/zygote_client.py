"""Asking a cluster's zygote (:mod:`ddp_magics.engine.zygote`) for a process: the client side of
its socket. The launcher asks for engines; an engine asks for its nanny.

A request is one line of JSON sent with file descriptors as the client connects; the reply is
one line of JSON with the forked process's PID.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import socket
import sys
from pathlib import Path
from typing import BinaryIO

from ddp_magics.private_files import unix_address

SOCKET_NAME = "zygote.sock"
# Set in the engines the zygote forks: where to ask for their nannies.
ZYGOTE_SOCKET_ENV = "DDP_MAGICS_ZYGOTE"


def fork_engine(socket_path: Path, argv: list[str], env: dict[str, str], cwd: str, output: str) -> int:
    """Ask the zygote listening at ``socket_path`` for an engine; returns its PID."""
    request = {"engine": {"argv": argv, "env": env, "cwd": cwd, "output": output}}
    return _ask(socket_path, request, fds=[])


def signal_process(socket_path: Path, pid: int, signum: int) -> None:
    """Ask the zygote listening at ``socket_path`` to send ``signum`` to ``pid``, if it forked it."""
    _ask(socket_path, {"signal": [pid, signum]}, fds=[])


def fork_nanny(socket_path: Path, nanny_arguments: dict) -> tuple[str, BinaryIO]:
    """In an engine: what ``ipyparallel.engine.nanny.start_nanny`` returns (the URL the engine's
    control socket connects to, and the pipe to keep open), with the nanny forked by the zygote
    rather than started as a new Python (whose imports take about half a second)."""
    read_end, write_end = os.pipe()
    try:
        arguments = base64.b64encode(pickle.dumps({**nanny_arguments, "pid": os.getpid()})).decode()
        # The nanny writes its URL into the pipe, then watches it: it ends when this process does.
        # Its log goes where this engine's does.
        _ask(socket_path, {"nanny": arguments}, fds=[write_end, sys.stderr.fileno()])
    finally:
        os.close(write_end)
    pipe = os.fdopen(read_end, "rb")
    url = pipe.readline().decode().strip()
    if not url:
        pipe.close()
        raise RuntimeError("the nanny forked by the zygote did not start (see the engine's log)")
    return url, pipe


def _ask(socket_path: Path, request: dict, fds: list[int]) -> int:
    """Send one request (with file descriptors) to the zygote; returns the forked PID."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        with unix_address(socket_path) as address:
            connection.connect(address)
        socket.send_fds(connection, [json.dumps(request).encode() + b"\n"], fds)
        reply = connection.makefile().readline()
    if not reply:
        raise RuntimeError(f"the zygote at {socket_path} closed the connection without forking")
    return int(json.loads(reply)["pid"])
