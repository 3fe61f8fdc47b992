"""Recovering a rank in place (``%dist_recover``): its process, variables, tensors and models
stay; only its process groups are cut and made anew.

A rank blocked in a collective whose peers never come waits in C++ (gloo waits for the
process group's timeout, half an hour by default); neither an interrupt nor gloo's own
``abort()`` wakes it (torch 2.13: ``ProcessGroupGloo.abort``/``shutdown`` leave a pending
``allreduce`` waiting). What does wake it is its connections closing: gloo's pairs then fail
the operation with "Connection closed by peer". So on ``CUT_CONNECTIONS_SIGNAL`` every rank,
busy or not, from a thread of its own:

- aborts its NCCL communicators (``ProcessGroup.abort``, NCCL's documented way out);
- shuts down (``shutdown(2)``, both ways) the connected sockets of gloo's event loops: every
  epoll instance made after the engine's own (ipyparallel's and the kernel's, noted before
  the first process group formed), leaving listening sockets alone (gloo's listener aborts
  the process if its socket fails).

Each side's blocked operation then raises at once, and the cell ends on that rank; a rank
running Python (``while True:``) is interrupted by the notebook after this. Then every rank
destroys its old groups and joins a new default group (``engine.rank.rejoin_process_group``).

Like the inspector, the signal is answered by faulthandler in C, writing into a pipe this
module's thread sleeps on: the signal reaches engines on any host through ipyparallel's
signal request, and the thread runs whatever the main thread is doing.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import select
import signal
import socket
import threading

from ddp_magics.engine.inspector import dump_pipe
from ddp_magics.protocol import CUT_CONNECTIONS_SIGNAL

_engine_event_loops: frozenset[int] | None = None
_wake_pipe = None  # the write end, kept open for faulthandler
_read_end: int | None = None
# Held while cutting. Between begin_forming() and end_forming() the main thread makes new groups,
# whose connections a signal answered late (sent before) must not cut.
_lock = threading.Lock()
_forming = False
# The addresses ("[address]:port") of both ends of every connection recovery shut down, and of
# the old groups' listening sockets: gloo names a pair by its peer's listening address when an
# object still holding an old group (a DDP wrapper) uses it.
cut_peers: set[str] = set()


def note_engine_event_loops() -> None:
    """Once, before the first process group forms: the epoll instances the engine itself made
    (zmq's, the kernel's asyncio loop), which recovery never touches."""
    global _engine_event_loops
    if _engine_event_loops is None:
        _engine_event_loops = frozenset(_event_loops())


def start_connection_cutter() -> None:
    """Once per engine: answer ``CUT_CONNECTIONS_SIGNAL`` from a thread of its own."""
    global _wake_pipe, _read_end
    if _wake_pipe is not None:
        return
    _read_end, write_end = dump_pipe()
    os.set_blocking(_read_end, False)
    _wake_pipe = os.fdopen(write_end, "wb", buffering=0)
    # all_threads: the kernel may hand a process's signal to any thread not blocking it, gloo's
    # and zmq's included (seen after an outage between hosts); for a thread without Python,
    # faulthandler writes nothing unless all_threads, and the cut would be lost.
    faulthandler.register(CUT_CONNECTIONS_SIGNAL, file=_wake_pipe, all_threads=True)
    threading.Thread(target=_serve, name="ddp_magics recovery", daemon=True).start()


def _serve() -> None:
    global _cut_since_the_cell_began
    signal.pthread_sigmask(signal.SIG_BLOCK, {CUT_CONNECTIONS_SIGNAL})
    while True:
        select.select([_read_end], [], [])
        with _lock:
            if not _drain():
                continue  # the main thread, beginning to form groups, took (and answered) it
            if not _forming:
                _cut_since_the_cell_began = True
                cut_connections()


# Set by a cut, cleared as a cell begins: the running cell's error, if it ends in one, is the
# cut's doing, and nobody reads it (the notebook reports a released or recovered rank by where
# it waited). Formatting it would cost each rank up to a second of CPU the first time IPython
# reads torch.distributed's files, which 32 ranks on 2 cores pay as the recovery waits for them.
_cut_since_the_cell_began = False


def errors_after_a_cut_unformatted(shell) -> None:
    """Once per engine: while a cut has happened since the running cell began, the cell's error
    is shown as its one last line instead of a formatted traceback."""
    formatter = shell.InteractiveTB
    if getattr(formatter, "_ddp_magics_full", None) is not None:
        return
    full = formatter.structured_traceback

    def structured_traceback(etype, evalue, *args, **kwargs):
        if _cut_since_the_cell_began:
            return [f"{etype.__name__}: {evalue} (ended by a recovery's cut; traceback not formatted)"]
        return full(etype, evalue, *args, **kwargs)

    def cell_begins(info) -> None:
        global _cut_since_the_cell_began
        _cut_since_the_cell_began = False

    formatter._ddp_magics_full = full
    formatter.structured_traceback = structured_traceback
    shell.events.register("pre_run_cell", cell_begins)


def _drain() -> bool:
    """Empty the wake-up pipe (a signal's traceback, not needed); whether anything was in it."""
    drained = False
    with contextlib.suppress(BlockingIOError):
        while os.read(_read_end, 1 << 20):
            drained = True
    return drained


def begin_forming() -> None:
    """On the main thread, before this rank makes the store or the groups of a new era (rank 0
    opening a rendezvous, every rank rejoining): cut what is left of the old groups now, and
    make sure a cut signal still unanswered cuts nothing made from here on."""
    global _forming
    note_engine_event_loops()
    start_connection_cutter()
    with _lock:
        if _forming:
            return
        _forming = True
        _drain()
        cut_connections()


def end_forming() -> None:
    global _forming
    with _lock:
        _forming = False


def cut_connections() -> int:
    """Abort this rank's NCCL groups and shut down its gloo connections; how many sockets were
    shut down."""
    import torch.distributed as dist

    if dist.is_initialized():
        for group in _process_groups():
            if "nccl" in _backend_names(group):
                group.abort()
    return _shut_down_group_sockets()


def _process_groups() -> list:
    from torch.distributed import distributed_c10d

    return list(distributed_c10d._world.pg_map)


def _backend_names(group) -> set[str]:
    try:
        return {name.lower() for name in group._get_backend_name().split(",")}
    except RuntimeError:
        return set()


def _shut_down_group_sockets() -> int:
    known = _engine_event_loops or frozenset()
    count = 0
    for epoll_fd, registered in _event_loops().items():
        if epoll_fd in known:
            continue
        for fd in registered:
            count += _shut_down(fd)
    return count


def _shut_down(fd: int) -> int:
    """Shut down ``fd`` both ways if it is a connected stream socket; 1 if it was. The addresses
    of its ends (or of a listening socket, left open) go into ``cut_peers``."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:  # closed since, or not a socket
        return 0
    try:
        if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
            return 0
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            cut_peers.update(_as_gloo_writes(sock.getsockname()))
            return 0
        ends = [sock.getsockname(), sock.getpeername()]
        sock.shutdown(socket.SHUT_RDWR)
        for end in ends:
            cut_peers.update(_as_gloo_writes(end))
        return 1
    except OSError:  # not connected (any more)
        return 0
    finally:
        sock.close()


def _as_gloo_writes(end: tuple) -> set[str]:
    """An address as gloo may write it in an error: ``[127.0.0.1]:29500``, and with the port's
    bytes swapped (``[127.0.0.1]:15475``), as torch 2.13's gloo writes a pair's peer (its
    ``Address::str`` prints the port in network byte order)."""
    host, port = end[0], end[1]
    swapped = int.from_bytes(port.to_bytes(2, "big"), "little")
    return {f"[{host}]:{port}", f"[{host}]:{swapped}"}


def _event_loops() -> dict[int, list[int]]:
    """This process's epoll instances and the descriptors each watches (from /proc/self/fdinfo)."""
    loops = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") != "anon_inode:[eventpoll]":
                continue
            with open(f"/proc/self/fdinfo/{name}") as info:
                loops[int(name)] = [int(line.split()[1]) for line in info if line.startswith("tfd:")]
        except OSError:  # closed while listed
            continue
    return loops


def stale_objects(namespace: dict) -> list[tuple[str, str]]:
    """Names in ``namespace`` whose value is, or holds, a process group or device mesh that
    recovery is about to destroy: ``(name, type name)``, in the namespace's order."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    found = []
    for name, value in list(namespace.items()):
        if name.startswith("_") or isinstance(value, type):
            continue
        try:
            holds_group = isinstance(value, (dist.ProcessGroup, DeviceMesh)) or isinstance(
                getattr(value, "process_group", None), dist.ProcessGroup
            )
        except Exception:  # a user object whose attribute raises holds no group of ours
            holds_group = False
        if holds_group:
            found.append((name, type(value).__name__))
    return found
