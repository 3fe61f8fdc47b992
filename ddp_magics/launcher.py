"""ipyparallel engine launchers adapted to ddp_magics: the notebook side.

Part of the cluster layer: only :mod:`ddp_magics.cluster` uses it.

- Local engines forked by the cluster's zygote (:mod:`ddp_magics.engine.zygote`): :class:`Zygote`
  starts and stops the zygote process; :class:`ZygoteEngineSetLauncher` is an ipyparallel engine
  launcher (``ipyparallel.Cluster(engines=ZygoteEngineSetLauncher)``), so ipyparallel still owns
  the controller, engine ids, signals and stop, and only how an engine process comes to be differs.
- Engines on other hosts over ssh: :class:`StoppedFirstSSHEngineSetLauncher`, ipyparallel's SSH
  launcher with a stop that fits engines already killed through their nannies.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
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

from ddp_magics.engine.zygote import READY
from ddp_magics.engine.zygote_client import SOCKET_NAME, fork_engine
from ddp_magics.lifetime import CLUSTER_DIR_ENV

ZYGOTE_LOG = "zygote.log"


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


class Zygote:
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

    def alive(self) -> bool:
        return self.process.poll() is None

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



class StoppedFirstSSHEngineLauncher(SSHEngineLauncher):
    """ipyparallel's SSH engine launcher, started alongside the others of its set (see below), for
    engines that ddp_magics stops first (SIGKILL through their nannies, see ``cluster.stop``).
    Stopping one then takes one ssh call that finds it gone, instead of a TERM to a PID that no
    longer exists (whose remote traceback would reach the notebook's log), a wait and a copy of
    its log back over scp.

    Each engine keeps its profile, logs and IPython directory in its host's private directory
    for the cluster (``host_workdirs``, made by :mod:`ddp_magics.engine.host`), not at the path
    of the kernel's directory, which on another host nobody has checked."""

    host_workdirs = Dict(config=True, help="host name -> the cluster's directory on that host")

    def start(self, hostname=None, user=None, port=None) -> None:
        self.loop  # noqa: B018 (fixes the launcher's event loop to this thread's, as ipyparallel asks)
        self._workdir = self.host_workdirs[hostname]
        self.remote_profile_dir = f"{self._workdir}/profile"
        self.remote_output_file = f"{self._workdir}/profile/log/ipengine-{time.time():.4f}.out"
        self.starting = self.parent.starting_pool.submit(super().start, hostname, user, port)

    async def stop(self) -> None:
        try:
            await self.join(timeout=0)
        except TimeoutError:  # still running after all: ipyparallel's TERM, wait, KILL
            await super().stop()

    def get_output(self, remove: bool = False) -> str:
        """The engine's log stays on its host, in the cluster's directory, which stop removes."""
        return ""

    def get_env(self) -> dict:
        return {
            **super().get_env(),
            CLUSTER_DIR_ENV: self._workdir,
            "IPYTHONDIR": f"{self._workdir}/ipython",
        }


class StoppedFirstSSHEngineSetLauncher(SSHEngineSetLauncher):
    """ipyparallel's SSH engine set (``engines = {host: n}``) with its engines started at once
    rather than one after another: each takes four ssh calls, one of them a remote
    ``IPython profile create`` (about 3 s an engine over a fast link)."""

    launcher_class = StoppedFirstSSHEngineLauncher

    def start(self, n: int) -> list:
        with ThreadPoolExecutor(max_workers=max(n, 1)) as self.starting_pool:
            started = super().start(n)
        for launcher in self.launchers.values():
            launcher.starting.result()  # the first engine that could not start raises here
        return started
