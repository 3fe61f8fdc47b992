"""The zygote: one process that imports torch once and forks the cluster's engines.

``import torch.distributed`` takes seconds; engines that each import it one after another on a
few cores take most of a cluster's start-up. The zygote imports it (with ipyparallel's engine
and ddp_magics' engine side) once, then forks each engine it is asked for, already imported:
``%dist_start`` pays one import, and ``%dist_restart`` none.

    python -m ddp_magics.engine.zygote         # in the environment of lifetime.launch_environment()
    python -m ddp_magics.engine.zygote --host  # on another host, over ssh (see below)

It prints ``ready`` when it listens on ``SOCKET_NAME`` in the cluster's directory. Each
connection carries one request, a JSON line, and gets the forked PID back: an engine
(ipengine's arguments, environment, working directory, output file), or an engine's nanny
(ipyparallel's arguments for it, with the pipe it writes to and its log passed as file
descriptors), which ipyparallel would otherwise start as a new Python process per engine; or a
signal for a process it forked.

With ``--host`` it is the zygote of one of a cluster's other hosts, started by one ssh session
whose forwarded socket brings the launcher's requests (``launcher.HostZygote``): its directory
is the host's for the cluster, it watches the owner through the lifeline, and an engine's
environment is added to its own (the host's). Told ``stop`` on its standard input (the cluster
stops), it kills what it forked, removes the directory and exits; should the session end
without it (a link lost), it exits alone: its engines go on, with the lifeline and heartbeats
of their own, and the next start on the host removes the directory once they are gone.
No thread or zmq context exists here before a fork; the zygote reaps what it forked as it
exits, and exits with its children when the cluster's owner ends (the owner's pidfd is in the
same ``select`` as the socket). Its clients' side is :mod:`ddp_magics.engine.zygote_client`.
"""

from __future__ import annotations

import base64
import contextlib
import gc
import importlib
import json
import os
import pickle
import select
import signal
import socket
import struct
import sys
from pathlib import Path

import psutil

from ddp_magics.engine.zygote_client import SOCKET_NAME, ZYGOTE_SOCKET_ENV
from ddp_magics.lifetime import (
    CLUSTER_DIR_ENV,
    LIFELINE_ENV,
    OWNER_ENV,
    POLL_SECONDS,
    Owner,
    exit_with_children,
    kill_now,
    lifeline_connection,
    record_process,
)
from ddp_magics.private_files import remove_tree, unix_address
from ddp_magics.protocol import ZYGOTE_CHILD_ENDED

# A line of the zygote's log for each process it forked that ended: this prefix, PID, how.
READY = "ready"
STOP = "stop"  # to a host's zygote (--host), on its standard input: the cluster stops
# Imported once, here, instead of in every engine: torch, ipyparallel's engine and nanny, the
# kernel parts an engine loads as it starts (the debugger alone is 0.1 s; the last five, which
# IPython and tornado import as the engine starts, 4 ms), ddp_magics' engine side. None of them
# starts a thread or a zmq context on import.
ENGINE_MODULES = (
    "torch.distributed",
    "ipyparallel.engine.app",
    "ipyparallel.engine.nanny",
    "ipykernel.ipkernel",
    "ipykernel.debugger",
    "IPython.extensions.storemagic",
    "ddp_magics.engine.process",
    "ddp_magics.engine.rank",
    "ddp_magics.engine.recorder",
    "IPython.core.oinspect",
    "IPython.core.completerlib",
    "IPython.core.logger",
    "IPython.utils.wildcard",
    "tornado.platform.asyncio",
)
# More modules to import here, comma-separated, where every engine would import them for itself:
# a course's hub names torch._dynamo, which DistributedDataParallel imports as it is made
# (torch/nn/parallel/distributed.py:842), 69 MiB and a second or more of CPU in every rank, shared
# instead (course/spawner.py). One that cannot be imported is left to the engines.
PRELOAD_ENV = "DDP_MAGICS_ZYGOTE_PRELOAD"
# The zygote formats a traceback through torch.distributed once it has forked nothing for this
# long (the engines of a start have their first cell by then): see rank.warm_up_error_reports.
WARM_UP_WHEN_IDLE_SECONDS = 2.0
REQUEST_CHUNK = 1 << 16
MAX_REQUEST_BYTES = 1 << 24  # an engine's whole environment fits many times over
MAX_FDS = 2
# A client sends its request as it connects; one that does not is dropped after this long.
REQUEST_SECONDS = 2.0


# ----------------------------------------------------------------- in the zygote
_forked: set[int] = set()  # what this zygote forked and has not reaped
_own_fds: list[int] = []  # the zygote's own (wake-up pipe, owner's pidfd, lifeline): not a child's


def main() -> None:
    on_host = sys.argv[1:] == ["--host"]
    if on_host:  # its settings (a secret among them) come first on its input, not in its arguments
        os.environ.update(json.loads(_first_line(sys.stdin.fileno())))
    cluster_dir = Path(os.environ[CLUSTER_DIR_ENV])
    owner = Owner.parse(os.environ[OWNER_ENV])
    record_process(cluster_dir, os.getpid())
    lifeline = lifeline_connection(os.environ[LIFELINE_ENV]) if os.environ.get(LIFELINE_ENV) else None
    _import_what_engines_import()
    _keep_out_of_collections()
    from ddp_magics.engine import rank

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with unix_address(cluster_dir / SOCKET_NAME) as address:
        listener.bind(address)  # the cluster's directory is private (0700)
    listener.listen()
    # A child's end wakes the loop, which reaps and logs it: a signal handler that wrote to the
    # log itself would be re-entered by the next child's end, and die (``reentrant call``).
    child_ended, wakeup = os.pipe()
    for fd in (child_ended, wakeup):
        os.set_blocking(fd, False)
    signal.set_wakeup_fd(wakeup)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    owner_gone = owner.pidfd() if owner.on_this_machine else None
    ended = [fd for fd in (owner_gone, lifeline) if fd is not None]  # readable as the owner goes
    _own_fds.extend([child_ended, wakeup, *(fd if isinstance(fd, int) else fd.fileno() for fd in ended)])
    stopped = [sys.stdin] if on_host else []  # readable (at its end) as the cluster stops
    told = b""  # what arrived on it so far: ``stop`` may come in more than one read
    print(READY, flush=True)
    # Without a pidfd, an owner on this machine is polled; one elsewhere is watched only through
    # the lifeline (none: nothing to watch, as for the engines that could not reach it either).
    polled = owner.on_this_machine and owner_gone is None
    while True:
        watched = [listener, child_ended, *ended, *stopped]
        idle_seconds = POLL_SECONDS if polled else None
        if not rank.error_reports_warm():
            idle_seconds = min(idle_seconds or WARM_UP_WHEN_IDLE_SECONDS, WARM_UP_WHEN_IDLE_SECONDS)
        readable, _, _ = select.select(watched, [], [], idle_seconds)
        if not readable and not rank.error_reports_warm():
            rank.warm_up_error_reports()  # for the engines forked from now on (restarts, replacements)
            _keep_out_of_collections()
        if child_ended in readable:
            while len(os.read(child_ended, 1 << 12)) == 1 << 12:
                pass
            _reap_children()
        if any(fd in readable for fd in ended) or (polled and not owner.alive()):
            exit_with_children(owner, cluster_dir if on_host else None)
        if stopped and sys.stdin in readable:
            said = os.read(sys.stdin.fileno(), 1 << 12)
            told += said
            if STOP.encode() in told:
                _stop(cluster_dir)
            if not said:  # the session was lost (the link?), not closed: its engines go on
                os._exit(0)
        if listener in readable:
            _serve_one(listener, merge_environment=on_host)


def _first_line(fd: int) -> bytes:
    """The first line of ``fd``, read byte by byte: nothing after it is taken from the pipe."""
    line = b""
    while not line.endswith(b"\n"):
        byte = os.read(fd, 1)
        if not byte:
            raise SystemExit("ddp_magics zygote: its settings did not arrive")
        line += byte
    return line


def _stop(cluster_dir: Path) -> None:
    """The cluster stops: kill what this zygote forked, remove the host's directory, exit."""
    kill_now(psutil.Process().children(recursive=True))
    if not remove_tree(cluster_dir):
        print(f"ddp_magics zygote: could not remove {cluster_dir}", file=sys.stderr)
    os._exit(0)


def _import_what_engines_import() -> None:
    gc.disable()  # no collection runs through the imports' objects, which live as long as we do
    try:
        for name in ENGINE_MODULES:
            importlib.import_module(name)
        for name in filter(None, os.environ.get(PRELOAD_ENV, "").split(",")):
            try:
                importlib.import_module(name.strip())
            except Exception as error:  # any import error: the engines import it themselves
                print(f"{PRELOAD_ENV}: {name} not imported: {error!r}", file=sys.stderr, flush=True)
    finally:
        gc.enable()


def _keep_out_of_collections() -> None:
    """What the zygote holds now (torch's 300,000 objects) is frozen: no collection here or in
    an engine forked from here goes through it (nor copies its pages by touching it). Python's
    advice for a process that forks without exec; the collections the imports would have run
    through it were 0.2 s of their 1.3 s."""
    gc.freeze()


def _serve_one(listener: socket.socket, merge_environment: bool = False) -> None:
    """Answer one connection; whatever a client does wrong costs that connection only."""
    try:
        connection, _ = listener.accept()
    except OSError as error:  # EMFILE, ECONNABORTED, ...
        print(f"ddp_magics zygote: could not accept a request: {error}", file=sys.stderr, flush=True)
        return
    with connection:
        connection.settimeout(REQUEST_SECONDS)
        try:
            _check_peer(connection)
            _answer(connection, listener, merge_environment)
        except (OSError, ValueError, KeyError, TypeError) as error:
            print(f"ddp_magics zygote: refused a request: {error!r}", file=sys.stderr, flush=True)


def _check_peer(connection: socket.socket) -> None:
    """PermissionError unless the client runs as this user (the socket's directory is private
    too; this holds should that ever not be so)."""
    credentials = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _ = struct.unpack("3i", credentials)
    if uid != os.geteuid():
        raise PermissionError(f"PID {pid} of uid {uid} is not this cluster's user (uid {os.geteuid()})")


def _answer(connection: socket.socket, listener: socket.socket, merge_environment: bool) -> None:
    first, fds, _, _ = socket.recv_fds(connection, REQUEST_CHUNK, MAX_FDS)
    try:
        request = _read_request(connection, first)
        if isinstance(request.get("signal"), list):
            pid, number = (int(value) for value in request["signal"])
            if pid in _forked:  # never a process this zygote did not fork
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, number)
            connection.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            return
        if not (isinstance(request.get("engine"), dict) or isinstance(request.get("nanny"), str)):
            raise ValueError(f"not a request for an engine or a nanny: {sorted(request)}")
        if "nanny" in request and len(fds) != MAX_FDS:
            raise ValueError(f"a nanny request carries {MAX_FDS} file descriptors, not {len(fds)}")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    pid = os.fork()
    if pid == 0:
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for fd in _own_fds:
                os.close(fd)
            os.setsid()  # like ipyparallel's launchers: the notebook's signals are not its own
            listener.close()
            connection.close()
            if "engine" in request:
                _become_engine(request["engine"], merge_environment)
            else:
                _become_nanny(request["nanny"], *fds)
        finally:
            os._exit(1)  # a fork never returns into the zygote's loop
    _forked.add(pid)
    for fd in fds:
        os.close(fd)
    connection.sendall(json.dumps({"pid": pid}).encode() + b"\n")


def _read_request(connection: socket.socket, first: bytes) -> dict:
    line = first
    while not line.endswith(b"\n"):
        if len(line) > MAX_REQUEST_BYTES:
            raise ValueError(f"a request longer than {MAX_REQUEST_BYTES} bytes")
        more = connection.recv(REQUEST_CHUNK)
        if not more:
            raise ConnectionError("a request to the zygote ended before its newline")
        line += more
    request = json.loads(line)
    if not isinstance(request, dict):
        raise ValueError("a request is a JSON object")
    return request


def _become_nanny(arguments: str, pipe_fd: int, log_fd: int) -> None:
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    from ddp_magics.engine.nanny import GroupNanny

    # Line-buffered: the engine waits for the first line, the URL.
    GroupNanny.main(**pickle.loads(base64.b64decode(arguments)), pipe=os.fdopen(pipe_fd, "w", buffering=1))
    os._exit(0)


def _become_engine(request: dict, merge_environment: bool) -> None:
    output = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(output, 1)
    os.dup2(output, 2)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.chdir(request["cwd"])
    if not merge_environment:
        os.environ.clear()
    os.environ.update(request["env"])
    os.environ[ZYGOTE_SOCKET_ENV] = str(Path(os.environ[CLUSTER_DIR_ENV]) / SOCKET_NAME)
    _reseed_random_generators()
    from ddp_magics.engine.process import run

    run(request["argv"])
    os._exit(0)


def _reseed_random_generators() -> None:
    """A fork copies the zygote's random state; a process of its own would have seeded each
    generator afresh from the operating system. So do that: every rank draws its own numbers
    (a seed a cell sets later still wins)."""
    import random

    import torch

    random.seed()
    torch.seed()
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()


def _reap_children() -> None:
    """Reap what ended, and log how (the notebook reads it to say how a rank died)."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _forked.discard(pid)
        print(f"{ZYGOTE_CHILD_ENDED}{pid} {how_it_ended(status)}", file=sys.stderr, flush=True)


def how_it_ended(status: int) -> str:
    """``killed by SIGSEGV (Segmentation fault)`` or ``exited with status 3``, from a wait status."""
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = f"signal {number}"
        description = signal.strsignal(number)
        return f"killed by {name}" + (f" ({description})" if description else "")
    return f"exited with status {os.WEXITSTATUS(status)}"


if __name__ == "__main__":
    main()
