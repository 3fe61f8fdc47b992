"""ipyparallel engine launchers adapted to ddp_magics: the notebook side.

Part of the cluster layer (:mod:`ddp_magics.cluster`): only its lifecycle and hosts use it.

- Local engines forked by the cluster's zygote (:mod:`ddp_magics.engine.zygote`): :class:`Zygote`
  starts and stops the zygote process; :class:`ZygoteEngineSetLauncher` is an ipyparallel engine
  launcher (``ipyparallel.Cluster(engines=ZygoteEngineSetLauncher)``), so ipyparallel still owns
  the controller, engine ids, signals and stop, and only how an engine process comes to be differs.
- Engines on other hosts over ssh: :class:`HostZygote`, one zygote per host started by one ssh
  session that forwards its socket, and :class:`HostZygoteEngineSetLauncher`, ipyparallel's SSH
  engine set whose engines that zygote forks.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
from ipyparallel.cluster.launcher import (
    LocalEngineLauncher,
    LocalEngineSetLauncher,
    ProcessStateError,
    SSHEngineLauncher,
    SSHEngineSetLauncher,
)
from traitlets import Dict

from ddp_magics.engine.zygote import READY, STOP
from ddp_magics.engine.zygote_client import SOCKET_NAME, fork_engine, signal_process
from ddp_magics.lifetime import CLUSTER_DIR_ENV

ZYGOTE_LOG = "zygote.log"
# How long a host's ssh session may take to end once told to.
SESSION_END_SECONDS = 3.0


# Variables of torch and the libraries it loads; some are read once, on import (TORCH_DISTRIBUTED_DEBUG).
IMPORT_TIME_PREFIXES = ("TORCH", "PYTORCH", "NCCL_", "GLOO_", "CUDA_", "OMP_", "MKL_", "KMP_")
# Read as a process starts: where Python finds modules and the loader finds libraries.
PROCESS_START_VARIABLES = ("PYTHONPATH", "PYTHONHOME", "PYTHONSAFEPATH", "LD_LIBRARY_PATH", "LD_PRELOAD")


def _import_time_settings() -> dict[str, str]:
    return {
        name: value
        for name, value in os.environ.items()
        if name.startswith(IMPORT_TIME_PREFIXES) or name in PROCESS_START_VARIABLES
    }


class ZygoteError(RuntimeError):
    """The zygote did not start (its log says why)."""


class _ZygoteProcess:
    """A zygote process seen from the notebook: it says ``ready`` on its standard output."""

    process: subprocess.Popen
    log_path: Path

    def wait_ready(self, timeout: float) -> None:
        """Wait until the zygote has imported everything and listens."""
        readable, _, _ = select.select([self.process.stdout], [], [], timeout)
        line = self.process.stdout.readline().decode().strip() if readable else ""
        if line != READY:
            self.stop()
            reason = "did not get ready" if not readable else "exited"
            raise ZygoteError(f"the engines' zygote {reason}: {self._log_tail()}")

    def _log_tail(self, lines: int = 5) -> str:
        text = self.log_path.read_text(errors="replace").strip().splitlines()
        return " | ".join(text[-lines:]) or "(nothing in its log)"

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, grace: float = 0.5) -> None:
        raise NotImplementedError


class Zygote(_ZygoteProcess):
    """The zygote process of one cluster, started at once so its imports overlap the
    controller's start-up."""

    def __init__(self, cluster_dir: Path, environment: dict[str, str]) -> None:
        self.cluster_dir, self.environment = cluster_dir, environment
        self.imported_with = _import_time_settings()
        self.log_path = cluster_dir / ZYGOTE_LOG
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "ddp_magics.engine.zygote"],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=log,
                env={**os.environ, **environment},
                start_new_session=True,  # the notebook's Ctrl-C is not the zygote's
            )

    def stop(self, grace: float = 0.5) -> None:
        """End the zygote (its engines are stopped before, through ipyparallel)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process.stdout.close()
        (self.cluster_dir / SOCKET_NAME).unlink(missing_ok=True)

    def environment_changed(self) -> bool:
        """Whether the notebook's settings for torch differ from those the zygote imported it with."""
        return _import_time_settings() != self.imported_with

    def replacement(self) -> Zygote:
        """A new zygote for the same cluster, in the notebook's environment of now (this one stopped)."""
        self.stop()
        return Zygote(self.cluster_dir, self.environment)


class ZygoteEngineLauncher(LocalEngineLauncher):
    """One engine, forked by the zygote instead of started with ``Popen``; waiting for it,
    signalling and stopping it are ipyparallel's, by PID, as for any local engine."""

    def start(self) -> None:
        if self.state != "before":
            raise ProcessStateError(f"The process was already started and has state: {self.state}")
        environment = {**os.environ, **self.get_env()}
        pid = fork_engine(
            Path(environment[CLUSTER_DIR_ENV]) / SOCKET_NAME,
            argv=self.cluster_args + self.engine_args,
            env=environment,
            cwd=os.path.abspath(self.work_dir),
            output=self.output_file,
        )
        self.pid = pid
        self.process = psutil.Process(pid)
        self.notify_start(pid)
        self._start_waiting()  # LocalProcessLauncher's watcher: notices the engine's exit


class ZygoteEngineSetLauncher(LocalEngineSetLauncher):
    """ipyparallel's local engine set, each engine forked by the zygote."""

    launcher_class = ZygoteEngineLauncher


class HostZygote(_ZygoteProcess):
    """The zygote of one of the cluster's other hosts (``python -m ddp_magics.engine.zygote
    --host``), started by one ssh session that also forwards a socket of this machine to the
    zygote's: every engine of that host is then forked through it, with no other ssh call and
    no new import of torch, at start, restart and replacement alike. :meth:`close` stops the
    zygote, which kills what it forked and removes the host's directory for the cluster."""

    def __init__(
        self,
        ssh_command: list[str],
        target: list[str],
        python: str,
        host_workdir: str,
        local_socket: Path,
        environment: dict[str, str],
        log_path: Path,
    ) -> None:
        self.local_socket, self.log_path = local_socket, log_path
        zygote = f"{shlex.quote(python)} -m ddp_magics.engine.zygote --host"
        command = f"cd {shlex.quote(host_workdir)} && exec {zygote}"
        forward = f"{local_socket}:{host_workdir}/{SOCKET_NAME}"
        with open(log_path, "ab") as log:
            self.process = subprocess.Popen(
                [*ssh_command, "-T", "-o", "BatchMode=yes", "-o", "ExitOnForwardFailure=yes",
                 "-L", forward, *target, command],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                start_new_session=True,  # the notebook's Ctrl-C is not the session's
            )  # fmt: skip
        # Its settings (the lifeline's secret among them) go over the session, never on a command line.
        with contextlib.suppress(BrokenPipeError):  # ssh failed: wait_ready says why, from its log
            self.process.stdin.write(json.dumps(environment).encode() + b"\n")
            self.process.stdin.flush()

    def close(self) -> None:
        """Tell the zygote to stop: it kills its engines, removes the host's directory and exits,
        then the session ends (:meth:`stop` waits for that)."""
        if not self.process.stdin.closed:
            with contextlib.suppress(BrokenPipeError):  # the session has ended already
                self.process.stdin.write(STOP.encode() + b"\n")
                self.process.stdin.flush()
            with contextlib.suppress(BrokenPipeError):
                self.process.stdin.close()

    def stop(self, grace: float = SESSION_END_SECONDS) -> None:
        """End the session (see :meth:`close`) and wait for it to end."""
        self.close()
        if self.process.poll() is None:
            try:
                self.process.wait(timeout=grace)
            except subprocess.TimeoutExpired:  # ssh's end still closes the session over there
                self.process.kill()
                self.process.wait()
        self.process.stdout.close()
        self.local_socket.unlink(missing_ok=True)


class HostZygoteEngineLauncher(SSHEngineLauncher):
    """One engine on another host, forked by that host's zygote through the socket its ssh
    session forwards (see :class:`HostZygote`); signalled through the zygote too."""

    host_sockets = Dict(config=True, help="host name -> this machine's socket forwarded to its zygote")
    host_workdirs = Dict(config=True, help="host name -> the cluster's directory on that host")

    def start(self, hostname=None, user=None, port=None) -> None:
        self.loop  # noqa: B018 (fixes the launcher's event loop to this thread's, as ipyparallel asks)
        self.hostname = hostname
        self._socket = Path(self.host_sockets[hostname])
        workdir = self.host_workdirs[hostname]
        environment = {
            **self.get_env(),
            CLUSTER_DIR_ENV: workdir,
            "IPYTHONDIR": f"{workdir}/ipython",
            "IPP_PROFILE_DIR": f"{workdir}/profile",
        }
        name = self.identifier.replace("/", "-")
        self.pid = fork_engine(
            self._socket,
            argv=self.cluster_args + self.engine_args,
            env=environment,
            cwd=workdir,
            output=f"{workdir}/profile/log/ipengine-{name}-{time.time():.4f}.out",
        )
        self.notify_start({"host": self.location, "pid": self.pid})

    def signal(self, sig) -> None:
        if self.state == "running":
            number = sig if isinstance(sig, int) else getattr(signal, f"SIG{sig}")
            with contextlib.suppress(OSError, RuntimeError):  # the zygote, or its session, is gone
                signal_process(self._socket, self.pid, number)

    async def stop(self) -> None:
        """Engines are killed through their nannies first (``cluster.stop``): this makes sure."""
        self.signal(signal.SIGKILL)
        self.notify_stop({"exit_code": None, "pid": self.pid, "identifier": self.identifier})

    async def join(self, timeout=None) -> None:
        return None

    def get_output(self, remove: bool = False) -> str:
        """The engine's log stays on its host, in the cluster's directory, which stop removes."""
        return ""


class HostZygoteEngineSetLauncher(SSHEngineSetLauncher):
    """ipyparallel's SSH engine set (``engines = {host: n}``), each engine forked by its host's
    zygote: no ssh call per engine (ipyparallel's SSH launcher makes four, one of them a remote
    ``IPython profile create``, and polls each engine over ssh while it runs)."""

    launcher_class = HostZygoteEngineLauncher
