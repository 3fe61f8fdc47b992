"""The zygote: one process that imports torch once and forks the cluster's engines.

``import torch.distributed`` takes seconds; engines that each import it one after another on a
few cores take most of a cluster's start-up. The zygote imports it (with ipyparallel's engine
and ddp_magics' engine side) once, then forks each engine it is asked for, already imported:
``%dist_start`` pays one import, and ``%dist_restart`` none.

    python -m ddp_magics.engine.zygote    # in the environment of lifetime.launch_environment()

It prints ``ready`` when it listens on ``SOCKET_NAME`` in the cluster's directory. Each
connection carries one request, a JSON line, and gets the forked PID back: an engine
(ipengine's arguments, environment, working directory, output file), or an engine's nanny
(ipyparallel's arguments for it, with the pipe it writes to and its log passed as file
descriptors), which ipyparallel would otherwise start as a new Python process per engine.
No thread or zmq context exists here before a fork; the zygote reaps what it forked as it
exits, and exits with its children when the cluster's owner ends (the owner's pidfd is in the
same ``select`` as the socket).
"""

from __future__ import annotations

import base64
import importlib
import json
import os
import pickle
import select
import signal
import socket
import sys
from pathlib import Path
from typing import BinaryIO

from ddp_magics.lifetime import (
    CLUSTER_DIR_ENV,
    OWNER_ENV,
    POLL_SECONDS,
    Owner,
    exit_with_children,
    record_process,
)

SOCKET_NAME = "zygote.sock"
# Set in the engines the zygote forks: where to ask for their nannies.
ZYGOTE_SOCKET_ENV = "DDP_MAGICS_ZYGOTE"
READY = "ready"
# Imported once, here, instead of in every engine: torch, ipyparallel's engine and nanny, the
# kernel parts an engine loads as it starts (the debugger alone is 0.1 s), ddp_magics' engine
# side. None of them starts a thread or a zmq context on import.
ENGINE_MODULES = (
    "torch.distributed",
    "ipyparallel.engine.app",
    "ipyparallel.engine.nanny",
    "ipykernel.ipkernel",
    "ipykernel.debugger",
    "IPython.extensions.storemagic",
    "ddp_magics.engine.rank",
    "ddp_magics.engine.recorder",
)
REQUEST_CHUNK = 1 << 16
MAX_FDS = 2


def fork_engine(socket_path: Path, argv: list[str], env: dict[str, str], cwd: str, output: str) -> int:
    """Ask the zygote listening at ``socket_path`` for an engine; returns its PID."""
    request = {"engine": {"argv": argv, "env": env, "cwd": cwd, "output": output}}
    return _ask(socket_path, request, fds=[])


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
        connection.connect(str(socket_path))
        socket.send_fds(connection, [json.dumps(request).encode() + b"\n"], fds)
        reply = connection.makefile().readline()
    if not reply:
        raise RuntimeError(f"the zygote at {socket_path} closed the connection without forking")
    return int(json.loads(reply)["pid"])


# ----------------------------------------------------------------- in the zygote
def main() -> None:
    cluster_dir = Path(os.environ[CLUSTER_DIR_ENV])
    owner = Owner.parse(os.environ[OWNER_ENV])
    record_process(cluster_dir, os.getpid())
    _import_what_engines_import()

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(cluster_dir / SOCKET_NAME))  # the cluster's directory is private (0700)
    listener.listen()
    signal.signal(signal.SIGCHLD, _reap_children)
    owner_gone = owner.pidfd()
    print(READY, flush=True)
    while True:
        watched = [listener] if owner_gone is None else [listener, owner_gone]
        readable, _, _ = select.select(watched, [], [], POLL_SECONDS if owner_gone is None else None)
        if (owner_gone in readable) if owner_gone is not None else not owner.alive():
            exit_with_children(owner)
        if listener in readable:
            connection, _ = listener.accept()
            with connection:
                _answer(connection, listener)


def _import_what_engines_import() -> None:
    for name in ENGINE_MODULES:
        importlib.import_module(name)


def _answer(connection: socket.socket, listener: socket.socket) -> None:
    first, fds, _, _ = socket.recv_fds(connection, REQUEST_CHUNK, MAX_FDS)
    line = first
    while not line.endswith(b"\n"):
        more = connection.recv(REQUEST_CHUNK)
        if not more:
            raise ConnectionError("a request to the zygote ended before its newline")
        line += more
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        try:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os.setsid()  # like ipyparallel's launchers: the notebook's signals are not its own
            listener.close()
            connection.close()
            if "engine" in request:
                _become_engine(request["engine"])
            else:
                _become_nanny(request["nanny"], *fds)
        finally:
            os._exit(1)  # a fork never returns into the zygote's loop
    for fd in fds:
        os.close(fd)
    connection.sendall(json.dumps({"pid": pid}).encode() + b"\n")


def _become_nanny(arguments: str, pipe_fd: int, log_fd: int) -> None:
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    from ipyparallel.engine.nanny import KernelNanny

    # Line-buffered: the engine waits for the first line, the URL.
    KernelNanny.main(**pickle.loads(base64.b64decode(arguments)), pipe=os.fdopen(pipe_fd, "w", buffering=1))
    os._exit(0)


def _become_engine(request: dict) -> None:
    output = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(output, 1)
    os.dup2(output, 2)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ[ZYGOTE_SOCKET_ENV] = str(Path(os.environ[CLUSTER_DIR_ENV]) / SOCKET_NAME)
    if "numpy.random" in sys.modules:  # a fork shares the seed; a new process would not
        sys.modules["numpy.random"].seed()
    from ddp_magics.engine.process import run

    run(request["argv"])
    os._exit(0)


def _reap_children(signum, frame) -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


if __name__ == "__main__":
    main()
