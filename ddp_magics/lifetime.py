"""How long a cluster's processes live: the process that owns them, and nothing after it.

A cluster belongs to the process that started it (the notebook's kernel). The notebook side
puts that owner into the environment of the controller and engines it launches
(:func:`launch_environment`); each of them calls :func:`watch_owner` first thing. A daemon
thread then blocks on a pidfd of the owner, and when the owner ends, for whatever reason
(shut down, SIGKILL, a crash), the process kills its own children (an engine's nanny, the
controller's schedulers) and exits at once, whatever its main thread is doing: a rank blocked
in a gloo collective included. The controller also waits for the engines and removes the
cluster's directory, so nothing is left for a later kernel to clean up.

This module runs on both sides and imports neither ipyparallel nor notebook code.
"""

from __future__ import annotations

import contextlib
import errno
import hmac
import json
import logging
import os
import secrets
import select
import selectors
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import psutil

from ddp_magics.private_files import remove_tree
from ddp_magics.shared_memory import segments_removed_after

OWNER_ENV = "DDP_MAGICS_OWNER"
CLUSTER_DIR_ENV = "DDP_MAGICS_CLUSTER_DIR"
# ADDRESS:PORT where the owner listens for engines on other hosts, which cannot watch its PID:
# a connection to it ends when the owner's process does.
LIFELINE_ENV = "DDP_MAGICS_LIFELINE"
# Where pidfds are missing (not Linux, or a kernel before 5.3) the owner is polled this often.
POLL_SECONDS = 0.2
OWNER_GONE_EXIT_CODE = 3
RECORDED_PIDS_FILE = "processes"  # PIDs of the cluster's processes ipyparallel does not list
HEART_MONITOR_PID_FILE = "heart_monitor.pid"  # stopped with a parked cluster's ranks (cluster/parking.py)
EXIT_POLL_SECONDS = 0.02
# A lifeline client must send the secret within this time.
AUTH_SECONDS = 10.0
ACCEPT_BACKOFF_SECONDS = 0.1
# A lifeline's ends notice the other's host gone after about this long (idle, then probes).
KEEPALIVE_SECONDS = 30
KEEPALIVE_IDLE_SECONDS = 10
KEEPALIVE_INTERVAL_SECONDS = 5
KEEPALIVE_PROBES = 4
LIFELINE_LOG = logging.getLogger("ddp_magics.lifeline")


@dataclass(frozen=True)
class Owner:
    """A process, told apart from a later one that reuses its PID by its start time, on the
    machine with this boot id (PIDs name processes of one machine only).

    The start time is the kernel's count of clock ticks from boot to the process's start
    (``/proc/PID/stat``, field 22): unlike a wall-clock create time, it stays the same when
    the clock is stepped (NTP, a suspended laptop, a changed date).
    """

    pid: int
    start_ticks: int
    boot_id: str

    @classmethod
    def this_process(cls) -> Owner:
        pid = os.getpid()
        return cls(pid, start_ticks(pid), machine_boot_id())

    @classmethod
    def parse(cls, text: str) -> Owner:
        """The inverse of :meth:`__str__`; ValueError if ``text`` is not one."""
        pid, ticks, boot_id = text.strip().split(":", 2)
        return cls(int(pid), int(ticks), boot_id)

    def __str__(self) -> str:
        return f"{self.pid}:{self.start_ticks}:{self.boot_id}"

    @property
    def on_this_machine(self) -> bool:
        return self.boot_id == machine_boot_id()

    def alive(self) -> bool:
        """Whether the owner still runs (on another machine this cannot be known: False)."""
        return self.on_this_machine and process_alive(self.pid, self.start_ticks)

    def pidfd(self) -> int | None:
        """A file descriptor that becomes readable when the owner exits (at once if it already
        has); None where the system has no pidfds (then poll :meth:`alive`)."""
        try:
            pidfd = os.pidfd_open(self.pid)
        except ProcessLookupError:
            return os.open(os.devnull, os.O_RDONLY)  # always readable: the owner is gone
        except (AttributeError, OSError):
            return None
        # Checked after opening the pidfd: a PID reused before it opened is another process.
        if not self.alive():
            os.close(pidfd)
            return os.open(os.devnull, os.O_RDONLY)
        return pidfd

    def wait(self) -> None:
        """Block until the owner has exited (at once if it already has)."""
        pidfd = self.pidfd()
        if pidfd is None:
            while self.alive():
                time.sleep(POLL_SECONDS)
            return
        try:
            select.select([pidfd], [], [])
        finally:
            os.close(pidfd)


def machine_boot_id() -> str:
    """Different on every machine (and every boot); the same in all its network namespaces."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return socket.gethostname()


def start_ticks(pid: int) -> int:
    """Clock ticks from boot to the start of process ``pid`` (/proc/PID/stat, field 22);
    ProcessLookupError if there is no such process."""
    return int(_stat_fields(pid)[22 - 3])


def _stat_fields(pid: int) -> list[bytes]:
    """The fields of /proc/PID/stat after the command name (field 3, the state, first)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except FileNotFoundError:
        raise ProcessLookupError(pid) from None
    # Field 2, the command name in parentheses, may itself hold spaces and parentheses.
    return stat[stat.rindex(b")") + 2 :].split()


_HAS_PROC = Path("/proc/self/stat").exists()


def process_alive(pid: int, started_at_ticks: int | None = None) -> bool:
    """Whether ``pid`` runs (not a zombie) and, if given, started at ``started_at_ticks``.
    Asked for every rank before every cell: one read of /proc where there is one."""
    try:
        if not _HAS_PROC:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        fields = _stat_fields(pid)
    except (ProcessLookupError, psutil.NoSuchProcess):
        return False
    if started_at_ticks is not None and int(fields[22 - 3]) != started_at_ticks:
        return False  # the PID was reused by another process
    return fields[0] != b"Z"


class Lifeline:
    """The owner's end of the lifelines: a listening socket that engines on other hosts connect
    to. The operating system closes it and every connection to it when the owner's process ends,
    however it ends (or when :meth:`close` is called). A thread accepts the connections, and
    closes each one whose engine has gone (so restarts do not fill the queue).

    Only the cluster's engines may hold a lifeline: each sends the lifeline's secret first
    (:attr:`environment_value` carries it to them, as the cluster's key reaches them); a
    connection that sends anything else, or nothing within ``auth_seconds``, is closed. One
    client's error, or running out of file descriptors, never stops the thread.
    """

    def __init__(self, address: str, auth_seconds: float = AUTH_SECONDS) -> None:
        self._auth_seconds = auth_seconds
        self._server = socket.create_server((address, 0))
        self.address = f"{address}:{self._server.getsockname()[1]}"
        self._secret = secrets.token_hex(16).encode()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._server, selectors.EVENT_READ)
        self._closing, self._waker = socket.socketpair()
        self._selector.register(self._closing, selectors.EVENT_READ)
        self._unauthenticated: dict[socket.socket, tuple[float, bytes]] = {}
        self._thread = threading.Thread(target=self._serve, name="ddp-magics-lifeline", daemon=True)
        self._thread.start()

    @property
    def environment_value(self) -> str:
        """``ADDRESS:PORT/SECRET``: what engines find in ``LIFELINE_ENV``."""
        return f"{self.address}/{self._secret.decode()}"

    def _serve(self) -> None:
        while True:
            events = self._selector.select(timeout=self._auth_seconds / 4 if self._unauthenticated else None)
            for key, _ in events:
                if key.fileobj is self._closing:
                    return
                if key.fileobj is self._server:
                    self._accept()
                else:
                    self._read(key.fileobj)
            self._drop_silent_clients()

    def _accept(self) -> None:
        try:
            connection, _ = self._server.accept()
        except OSError as error:  # EMFILE, ENFILE, ECONNABORTED, ...: this one connection is lost
            LIFELINE_LOG.warning("lifeline: could not accept a connection: %s", error)
            if error.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                time.sleep(ACCEPT_BACKOFF_SECONDS)  # the backlog waits; do not spin on it
            return
        keep_alive(connection)
        connection.setblocking(False)
        self._unauthenticated[connection] = (time.monotonic() + self._auth_seconds, b"")
        self._selector.register(connection, selectors.EVENT_READ)

    def _read(self, connection: socket.socket) -> None:
        try:
            data = connection.recv(len(self._secret) + 1)
        except OSError:  # ECONNRESET: that engine's end has gone
            data = b""
        if connection not in self._unauthenticated:
            if not data:  # engines send nothing more: readable means that engine's end has closed
                self._drop(connection)
            return
        deadline, received = self._unauthenticated[connection]
        received += data
        line, newline, _ = received.partition(b"\n")
        if not data or (newline and not hmac.compare_digest(line, self._secret)):
            self._drop(connection)
        elif newline:
            del self._unauthenticated[connection]
        elif len(received) > len(self._secret):
            self._drop(connection)
        else:
            self._unauthenticated[connection] = (deadline, received)

    def _drop_silent_clients(self) -> None:
        now = time.monotonic()
        for connection, (deadline, _) in list(self._unauthenticated.items()):
            if now > deadline:
                self._drop(connection)

    def _drop(self, connection: socket.socket) -> None:
        self._unauthenticated.pop(connection, None)
        self._selector.unregister(connection)
        connection.close()

    def close(self) -> None:
        self._waker.send(b"x")
        self._thread.join()
        for key in list(self._selector.get_map().values()):
            key.fileobj.close()
        self._selector.close()
        self._waker.close()


def keep_alive(connection: socket.socket) -> None:
    """TCP keepalive on an idle connection, so that either end learns within about
    ``KEEPALIVE_SECONDS`` that the other's host has gone (Linux's default: over 2 hours)."""
    connection.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (
        ("TCP_KEEPIDLE", KEEPALIVE_IDLE_SECONDS),
        ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_SECONDS),
        ("TCP_KEEPCNT", KEEPALIVE_PROBES),
        ("TCP_USER_TIMEOUT", KEEPALIVE_SECONDS * 1000),
    ):
        if hasattr(socket, option):  # Linux names; other systems keep their defaults
            connection.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


def launch_environment(cluster_dir: Path) -> dict[str, str]:
    """Environment for the processes this process launches for the cluster in ``cluster_dir``."""
    return {OWNER_ENV: str(Owner.this_process()), CLUSTER_DIR_ENV: str(cluster_dir)}


# ------------------------------------------------------------ in launched processes
def watch_owner(remove_cluster_dir: bool = False) -> None:
    """Exit with this process's children when the owner named in the environment ends.

    With ``remove_cluster_dir`` (the controller), first wait for the cluster's other
    processes to end and remove the cluster's directory.
    """
    owner_text = os.environ.get(OWNER_ENV)
    if not owner_text:
        return  # started by hand, not by ddp_magics: nobody to watch
    owner = Owner.parse(owner_text)
    cluster_dir = Path(os.environ[CLUSTER_DIR_ENV]) if remove_cluster_dir else None
    if owner.on_this_machine:
        _watch_in_thread(owner.wait, owner, cluster_dir)
    lifeline = os.environ.get(LIFELINE_ENV)
    if lifeline:  # engines launched on other hosts (ssh, mpi, slurm), wherever they landed
        _watch_in_thread(_lifeline_waiter(lifeline), owner, cluster_dir)


def _watch_in_thread(wait: Callable[[], None], owner: Owner, cluster_dir: Path | None) -> None:
    def watch() -> None:
        wait()
        exit_with_children(owner, cluster_dir)

    threading.Thread(target=watch, name="ddp-magics-owner-watch", daemon=True).start()


def lifeline_connection(lifeline: str) -> socket.socket | None:
    """A connection to the owner's :class:`Lifeline` (``LIFELINE_ENV``'s value); it ends (reads
    b"" or fails) as the owner or its host goes. None, said on stderr, if it cannot be made:
    then this process cannot watch the owner."""
    endpoint, _, secret = lifeline.partition("/")
    address, _, port = endpoint.rpartition(":")
    try:
        connection = socket.create_connection((address, int(port)), timeout=10)
        keep_alive(connection)
        connection.sendall(secret.encode() + b"\n")
    except OSError as error:
        print(
            f"ddp_magics: cannot reach the owner's lifeline {endpoint} ({error}); this process "
            "will not notice if the notebook's kernel ends",
            file=sys.stderr,
        )
        return None
    connection.settimeout(None)
    return connection


def _lifeline_waiter(lifeline: str) -> Callable[[], None]:
    """Connect to the owner's :class:`Lifeline` now; the returned function blocks until that
    connection ends."""
    connection = lifeline_connection(lifeline)
    if connection is None:
        return threading.Event().wait  # never set: nothing to watch

    def wait() -> None:
        # Ends with the connection: closed (b"") or reset or timed out (OSError) as the owner's
        # end or its host goes.
        with contextlib.suppress(OSError):
            while connection.recv(1):
                pass

    return wait


def exit_with_children(owner: Owner, cluster_dir: Path | None = None) -> None:
    """Kill this process's children and exit; with ``cluster_dir``, first wait for the cluster's
    other processes and remove the directory. Never returns."""
    print(f"ddp_magics: the cluster's owner (PID {owner.pid}) has ended; exiting", file=sys.stderr)
    me = psutil.Process()
    children = me.children(recursive=True)
    with segments_removed_after([me.pid, *(child.pid for child in children)]):  # MPI's, if a rank
        kill_now(children)
    if cluster_dir is not None:
        others = [p for p in cluster_processes(cluster_dir) if p.pid != me.pid]
        kill_now(wait_for_exit(others, timeout=2))  # they watch the owner too: normally gone
        # This process's main thread may still write in it (ipyparallel's hub saves its
        # engines' state as it hears of their end).
        if not remove_tree(cluster_dir):
            print(f"ddp_magics: could not remove {cluster_dir}", file=sys.stderr)
    os._exit(OWNER_GONE_EXIT_CODE)


# -------------------------------------------------------------- the cluster's files
def cluster_processes(cluster_dir: Path) -> list[psutil.Process]:
    """The controller and engines listed in the cluster's ipyparallel files, with their
    children (nannies, schedulers), as far as they still run.

    Also the processes listed by :func:`record_process`. A listed PID counts only if its
    environment names ``cluster_dir``: a PID reused by an unrelated process is never touched.
    A file half written or being removed lists nothing.
    """
    listed = recorded_pids(cluster_dir)
    for cluster_file in (cluster_dir / "profile" / "security").glob("cluster-*.json"):
        listed.extend(cluster_file_pids(cluster_file))
    processes: dict[int, psutil.Process] = {}
    for pid in dict.fromkeys(listed):
        try:
            process = psutil.Process(pid)
            if not _launched_for(process, cluster_dir):
                continue
            for member in [process, *process.children(recursive=True)]:
                processes.setdefault(member.pid, member)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return list(processes.values())


def _launched_for(process: psutil.Process, cluster_dir: Path) -> bool:
    environment = process.environ()
    # IPP_PROFILE_DIR, set by ipyparallel's launchers, also names clusters of older versions.
    return environment.get(CLUSTER_DIR_ENV) == str(cluster_dir) or environment.get("IPP_PROFILE_DIR") == str(
        cluster_dir / "profile"
    )


def record_process(cluster_dir: Path, pid: int) -> None:
    """List a process of the cluster that ipyparallel does not know of (the zygote)."""
    with open(cluster_dir / RECORDED_PIDS_FILE, "a") as file:
        file.write(f"{pid}\n")


def recorded_pids(cluster_dir: Path) -> list[int]:
    try:
        text = (cluster_dir / RECORDED_PIDS_FILE).read_text()
    except FileNotFoundError:
        return []
    return [int(line) for line in text.split() if line.isdigit()]


def cluster_file_pids(cluster_file: Path) -> list[int]:
    """PIDs of the controller and engines in an ``ipyparallel.Cluster`` file; none if the file
    is gone or not (yet, or any more) complete JSON."""
    try:
        data = json.loads(cluster_file.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return []
    pids = [data.get("controller", {}).get("state", {}).get("pid", -1)]
    for engine_set in data.get("engines", {}).get("sets", {}).values():
        pids.append(engine_set.get("pid", -1))  # a set that is one process (mpiexec)
        for engine in engine_set.get("engines", {}).values():  # a set of processes
            pids.append(engine.get("pid", -1))
    return [pid for pid in pids if isinstance(pid, int) and pid > 0]


def wait_for_exit(processes: Iterable[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait until the processes have exited; returns those still running after ``timeout``.
    A zombie has exited: only its parent's reaping is left (which ``psutil.wait_procs`` awaits)."""
    deadline = time.monotonic() + timeout
    running = list(processes)
    while True:
        running = [process for process in running if is_running(process)]
        if not running or time.monotonic() >= deadline:
            return running
        time.sleep(EXIT_POLL_SECONDS)


def is_running(process: psutil.Process) -> bool:
    """Running, and not a zombie (``Process.is_running`` also tells a reused PID apart)."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def kill_now(processes: Iterable[psutil.Process]) -> None:
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
