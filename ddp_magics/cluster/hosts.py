"""A cluster's other hosts, reached over ssh (``%dist_start --hosts``).

Each host is reached and prepared first, with one ssh call that makes its private directory for
the cluster and counts its GPUs (:mod:`ddp_magics.engine.host`); then it runs a zygote of its own
over one ssh session (:class:`~ddp_magics.cluster.launcher.HostZygote`), which forks every engine of the
host; when the cluster stops, each zygote kills what it forked and removes the host's directory
(one more ssh call removes it where no zygote runs). Part of the cluster layer
(:mod:`ddp_magics.cluster`).
"""

from __future__ import annotations

import json
import logging
import shlex
import subprocess
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from traitlets.config import Config

from ddp_magics.cluster.launcher import HostZygote, ZygoteError
from ddp_magics.cluster.records import HostSpec
from ddp_magics.lifetime import CLUSTER_DIR_ENV, LIFELINE_ENV, OWNER_ENV

# How long checking that a host answers over ssh may take.
SSH_CHECK_SECONDS = 15
LOG = logging.getLogger("ddp_magics.ipyparallel")


class HostError(RuntimeError):
    """A host could not be reached, prepared or given its zygote (one line: which and why)."""


class OtherHosts:
    """The hosts of one cluster, their directories for it and their zygotes."""

    def __init__(self, hosts: list[HostSpec], ssh_command: list[str], remote_python: str) -> None:
        self.hosts = hosts
        self.ssh_command = ssh_command
        self.remote_python = remote_python
        self.workdirs: dict[str, str] = {}  # location -> the cluster's directory on that host
        self.zygotes: dict[str, HostZygote] = {}  # location -> its zygote

    def prepare(self, cluster_name: str) -> dict[str, int]:
        """Reach every host over ssh before starting anything, and prepare it (see
        :mod:`ddp_magics.engine.host`); returns each one's GPU count, by location."""
        gpus = self.on_every_host(lambda host: self._prepare(host, cluster_name))
        return dict(zip([host.location for host in self.hosts], gpus))

    def _prepare(self, host: HostSpec, cluster_name: str) -> int:
        """Make the host's private directory for this cluster's engines (kept in ``workdirs``,
        so that :meth:`stop` removes it whatever fails next); returns its GPU count."""
        python = shlex.quote(self.remote_python)
        # Named per host too: two hosts may share a temp directory (over the network).
        name = f"{cluster_name}-{self.hosts.index(host)}"
        prepare = f"{python} -m ddp_magics.engine.host {shlex.quote(name)}"
        command = f"if test -x {python}; then {prepare}; else echo no {python} >&2; fi"
        try:
            answer = self.ssh(host, command)
        except subprocess.TimeoutExpired:
            raise HostError(f"{host.location} did not answer ssh within {SSH_CHECK_SECONDS} s") from None
        problem = answer.stderr.strip().splitlines()
        if answer.returncode != 0 or problem:
            reason = problem[-1] if problem else f"ssh exited with {answer.returncode}"
            raise HostError(f"cannot start engines on {host.location}: {reason}")
        try:
            prepared = json.loads(answer.stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            answered = answer.stdout
            raise HostError(f"cannot start engines on {host.location}: it answered {answered!r}") from None
        self.workdirs[host.location] = prepared["workdir"]
        return prepared["gpus"]

    def start_zygotes(self, environment: dict[str, str], local_dir: Path) -> None:
        """Start every host's zygote (their imports of torch run while the controller starts).
        ``environment``: the launched processes' (its owner and lifeline are passed on)."""
        for index, host in enumerate(self.hosts):
            workdir = self.workdirs[host.location]
            self.zygotes[host.location] = HostZygote(
                self.ssh_command,
                host.ssh_target,
                self.remote_python,
                workdir,
                self._socket(local_dir, index),
                {
                    OWNER_ENV: environment[OWNER_ENV],
                    LIFELINE_ENV: environment[LIFELINE_ENV],
                    CLUSTER_DIR_ENV: workdir,
                    "IPYTHONDIR": f"{workdir}/ipython",
                },
                local_dir / f"zygote-host-{index}.log",
            )

    def wait_for_zygotes(self, timeout: float) -> None:
        for location, zygote in self.zygotes.items():
            try:
                zygote.wait_ready(timeout)
            except ZygoteError as error:
                raise HostError(f"cannot start engines on {location}: {error}") from None

    def zygotes_alive(self) -> bool:
        return all(zygote.alive() for zygote in self.zygotes.values())

    def configure(self, config: Config, local_dir: Path) -> None:
        """ipyparallel's SSH engine set, with each engine forked by its host's zygote."""
        config.SSHEngineSetLauncher.engines = {host.location: host.ranks for host in self.hosts}
        config.SSHLauncher.ssh_cmd = self.ssh_command
        config.SSHLauncher.remote_python = self.remote_python
        config.SSHEngineLauncher.to_send = []
        config.HostZygoteEngineLauncher.host_workdirs = {
            host.name: self.workdirs[host.location] for host in self.hosts
        }
        config.HostZygoteEngineLauncher.host_sockets = {
            host.name: str(self._socket(local_dir, index)) for index, host in enumerate(self.hosts)
        }

    @staticmethod
    def _socket(local_dir: Path, index: int) -> Path:
        """This machine's end of the socket forwarded to the zygote of host ``index``."""
        return local_dir / f"host-{index}.sock"

    def stop(self) -> None:
        """Stop every zygote (each kills what it forked and removes its host's directory) and
        remove the directories of hosts with no zygote running (never started, or gone)."""
        running = {location for location, zygote in self.zygotes.items() if zygote.alive()}
        for zygote in self.zygotes.values():
            zygote.close()  # all at once: each then ends in its own time
        for zygote in self.zygotes.values():
            zygote.stop()
        self.zygotes = {}
        if self.workdirs:
            self._remove_directories([host for host in self.hosts if host.location not in running])
            self.workdirs = {}

    def _remove_directories(self, hosts: list[HostSpec]) -> None:
        """The engines' directories (profile, logs) on ``hosts``, removed with one ssh call per
        host at once."""

        def remove(host: HostSpec) -> None:
            workdir = self.workdirs.get(host.location)
            if workdir is None:
                return  # never prepared
            try:
                self.ssh(host, f"rm -rf -- {shlex.quote(workdir)}").check_returncode()
            except (subprocess.SubprocessError, OSError) as error:
                LOG.error("could not remove %s on %s: %s", workdir, host.location, error)

        self.on_every_host(remove, hosts)

    def on_every_host(self, action: Callable[[HostSpec], object], hosts: list | None = None) -> list:
        """``action(host)`` for every host (or those of ``hosts``) at once (each is mostly an
        ssh call)."""
        hosts = self.hosts if hosts is None else hosts
        if not hosts:
            return []
        with ThreadPoolExecutor(len(hosts)) as pool:
            return list(pool.map(action, hosts))

    def ssh(self, host: HostSpec, command: str) -> subprocess.CompletedProcess:
        """Run a shell ``command`` on ``host`` with the user's ssh, never asking for a password."""
        return subprocess.run(
            [*self.ssh_command, "-o", "BatchMode=yes", "-o", f"ConnectTimeout={SSH_CHECK_SECONDS}",
             *host.ssh_target, command],
            capture_output=True,
            text=True,
            timeout=SSH_CHECK_SECONDS + 5,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
