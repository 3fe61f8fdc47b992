"""One ipyparallel cluster whose engines are the ranks of a torch.distributed process group.

The notebook side of the extension talks to engines only through :class:`RankCluster`.
Nothing here prints or knows about IPython: progress goes to a callback, problems are
raised as the exceptions defined below.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import ipyparallel as ipp
import psutil
from ipyparallel.error import CompositeError, RemoteError
from traitlets.config import Config

from ddp_magics import protocol
from ddp_magics.engine import debugging, recorder
from ddp_magics.engine import rank as rank_code
from ddp_magics.engine.zygote import ENDED_PREFIX
from ddp_magics.hosts import HostError, HostSpec, OtherHosts
from ddp_magics.launcher import (
    HostZygoteEngineSetLauncher,
    Zygote,
    ZygoteEngineSetLauncher,
    ZygoteError,
)
from ddp_magics.lifetime import (
    LIFELINE_ENV,
    Lifeline,
    Owner,
    cluster_processes,
    kill_now,
    launch_environment,
    process_alive,
    wait_for_exit,
)
from ddp_magics.output import RankOutput
from ddp_magics.private_files import UnsafeDirectory, private_root, write_atomically
from ddp_magics.stacks import formatting_an_error, in_a_collective, parse_stack_dump

BACKENDS = ("auto", "gloo", "nccl")
# ipyparallel's names for its engine launchers that ddp_magics knows how to set up.
LAUNCHERS = ("local", "ssh", "mpi", "slurm")
CLUSTERS_ROOT_NAME = f"ddp_magics-{os.geteuid()}"  # under the temp directory, private to this user
OWNER_FILE = "owner"  # the kernel that started the cluster (lifetime.Owner), and its host's name
# A cluster directory without its owner file is being made, or being removed, for this long at most.
HALF_MADE_SECONDS = 60
LOCAL_HOST = "127.0.0.1"
# How long stopping waits for a step that normally takes milliseconds before forcing it.
STOP_GRACE_SECONDS = 0.5
# A short heartbeat period confirms new engines sooner; this much silence still means dead (for
# engines on this machine: those on other hosts get ``link_loss_seconds``, see RankCluster).
HEARTBEAT_SILENCE_MS = 3000
# ipyparallel's engine checks the controller's pings every heartbeat period plus this.
ENGINE_HEARTBEAT_CHECK_EXTRA_MS = 500
# How long a signal to the ranks (an interrupt, a stack dump, a cut) may take to be confirmed.
SIGNAL_SECONDS = 5.0
DEATH_RECORD_SECONDS = 0.5
# After their connections are cut, ranks blocked in a collective end within milliseconds (plus
# IPython formatting their error, longer on a loaded machine); a rank still running after this
# is running Python (or C code) of its own, and is interrupted.
CUT_WAIT_SECONDS = 1.0

Progress = Callable[[str], None]
# ipyparallel logs engines' output when they exit non-zero, as they do on SIGTERM at every stop;
# their logs stay in the cluster's log folder while it runs. Only its errors reach the user.
CLUSTER_LOG = logging.getLogger("ddp_magics.ipyparallel")
CLUSTER_LOG.setLevel(logging.ERROR)


class ClusterError(RuntimeError):
    """The cluster could not do what was asked (start, reach a rank, ...)."""


@dataclass(frozen=True)
class RankInfo:
    rank: int
    engine_id: int
    host: str
    pid: int
    local_rank: int
    device: str
    address: str = LOCAL_HOST  # of its host, as the controller's host reaches it
    group_rank: int = 0  # its host's place among the hosts


@dataclass(frozen=True)
class Recovery:
    """What :meth:`RankCluster.recover` did."""

    world_size: int
    replaced: list[int]  # ranks whose dead engine a new one (with nothing defined yet) replaced
    dropped: list[int]  # old numbers of the dead ranks a shrink left out
    renumbered: dict[int, int]  # old rank -> new rank, for the ranks a shrink renumbered
    interrupted: list[int]  # ranks that were running Python of their own, interrupted
    stale: dict[int, tuple[tuple[str, str], ...]]  # per rank: names that hold an old group
    cut_peers: dict[int, frozenset[str]]  # per rank: the peers of the old groups' connections
    seconds: float


@dataclass(frozen=True)
class RankStatus:
    info: RankInfo
    alive: bool


class CellRun:
    """One cell running on some ranks: what each rank has answered so far."""

    def __init__(self, result: ipp.AsyncResult, ranks: list[int]) -> None:
        self.ranks = ranks
        self._result = result
        # The AsyncResult's per-message metadata dicts, which the client updates as replies and
        # output arrive: read once here (each read of AsyncResult.metadata parses timestamps),
        # then looked at directly. Not the client's own table, which forgets a message as soon
        # as its output is complete (possibly before this line runs).
        answers = result.metadata
        self._answers = dict(zip(ranks, [answers] if isinstance(answers, dict) else answers))
        self._prompts_seen: dict[int, int] = {}  # per rank, the last debugger prompt answered
        self.quitting_debugger: set[int] = set()  # ranks sent q by the stop button

    def wait(self, timeout: float) -> bool:
        """Whether every rank has replied within ``timeout`` seconds."""
        return self._result.wait(timeout)

    def wait_for_output(self, timeout: float) -> None:
        """Replies can come before the last output of a rank: wait for that output too."""
        self._result.wait_for_output(timeout=timeout)

    def pending_ranks(self) -> list[int]:
        return [rank for rank, answer in self._answers.items() if answer["status"] is None]

    def errors(self) -> dict[int, BaseException]:
        """The exception each failed rank answered with (RemoteError, or EngineError if it died)."""
        answers = self._answers.items()
        return {rank: answer["error"] for rank, answer in answers if answer["status"] == "error"}

    def new_debugger_prompts(self) -> dict[int, protocol.DebuggerPrompt]:
        """Ranks stopped in ``breakpoint()`` at a prompt not handed out before, with the prompt."""
        prompts = {}
        for rank in self.pending_ranks():
            prompt = self.published(rank, protocol.DEBUGGER_KEY)
            if prompt is not None and prompt.number > self._prompts_seen.get(rank, 0):
                prompts[rank] = prompt
        return prompts

    def quit_debugging(self, rank: int) -> None:
        self.quitting_debugger.add(rank)

    def answer_prompt(self, rank: int, prompt: protocol.DebuggerPrompt) -> None:
        """``prompt`` of ``rank`` has been answered: not a new prompt any more."""
        self._prompts_seen[rank] = prompt.number

    def published(self, rank: int, key: str, wait: float = 0.0):
        """What ``rank`` last published under ``key`` in this cell (a data message); None if
        nothing arrived, after waiting up to ``wait`` seconds for it."""
        deadline = time.monotonic() + wait
        while (value := self._answers[rank].get("data", {}).get(key)) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return value

    def outputs(self) -> list[RankOutput]:
        """What each rank printed, displayed and returned so far, in rank order."""
        outputs = []
        for rank, answer in self._answers.items():
            result = answer.get("execute_result")
            outputs.append(
                RankOutput(
                    rank=rank,
                    stdout=answer.get("stdout", ""),
                    stderr=answer.get("stderr", ""),
                    result=result["data"] if result else None,
                    displays=[
                        {"data": out["data"], "metadata": out.get("metadata", {})}
                        for out in answer.get("outputs", [])
                    ],
                )
            )
        return outputs


def visible_gpu_count() -> int:
    """GPUs this process can see, without importing torch when there can be none."""
    if "torch" not in sys.modules and not Path("/dev/nvidiactl").exists():
        return 0
    import torch

    return torch.cuda.device_count()


def resolve_backend(requested: str, gpus_per_rank: list[int]) -> str:
    """auto means nccl when every rank has a GPU of its own, else gloo."""
    if requested != "auto":
        return requested
    return "nccl" if gpus_per_rank and all(gpus_per_rank) else "gloo"


class RankCluster:
    """Start, run on, inspect and stop a cluster of ``n`` ranks."""

    def __init__(
        self,
        n: int,
        backend: str = "auto",
        pg_timeout: float = 1800.0,
        heartbeat_ms: int = 100,
        link_loss_seconds: float = 30.0,
        engine_timeout: float = 60.0,
        engine_launcher: str = "local",
        hosts: list[HostSpec] | None = None,
        controller_ip: str | None = None,
        ssh_command: Iterable[str] = ("ssh",),
        remote_python: str = sys.executable,
        mpi_command: Iterable[str] = (),
        launcher_settings: dict | None = None,
    ) -> None:
        if n < 1:
            raise ValueError(f"a cluster needs at least one rank, not {n}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, not {backend!r}")
        if engine_launcher not in LAUNCHERS:
            raise ValueError(f"launcher must be one of {', '.join(LAUNCHERS)}, not {engine_launcher!r}")
        self.hosts = list(hosts or [])
        self.controller_ip = controller_ip
        self.ssh_command = list(ssh_command)
        self.remote_python = remote_python
        self.mpi_command = list(mpi_command) or [_mpiexec()]
        self.launcher_settings = launcher_settings or {}
        self._lifeline: Lifeline | None = None
        self._controller_address = LOCAL_HOST
        self.n = n
        self.requested_backend = backend
        self.backend: str | None = None
        self.pg_timeout = pg_timeout
        self.heartbeat_ms = heartbeat_ms
        # Engines on other hosts may go unheard this long (a network blip) before they count as
        # dead, on the controller's side and on their own (ipyparallel's engine exits then).
        self.link_loss_seconds = link_loss_seconds
        self.engine_timeout = engine_timeout
        self.engine_launcher = engine_launcher
        self.ranks: list[RankInfo] = []
        self.workdir: Path | None = None
        self._other_hosts = OtherHosts(self.hosts, self.ssh_command, self.remote_python)
        self._cluster: ipp.Cluster | None = None
        self._zygote: Zygote | None = None
        self._client: ipp.Client | None = None
        self._views: dict[tuple[int, ...], ipp.DirectView] = {}

    # ---------------------------------------------------------------- lifecycle
    @property
    def running(self) -> bool:
        return self._cluster is not None

    def start(self, progress: Progress | None = None) -> None:
        progress = progress or (lambda message: None)
        if self.running:
            raise ClusterError("this cluster is already running")
        try:
            self.workdir = Path(tempfile.mkdtemp(prefix="cluster-", dir=clusters_root()))
        except UnsafeDirectory as error:
            raise ClusterError(str(error)) from None
        _write_owner(self.workdir)
        try:
            self._start_engines(progress)
            self._form_process_group(progress)
        except BaseException:
            self.stop()
            raise

    def _start_engines(self, progress: Progress) -> None:
        self._controller_address = self._choose_controller_address()
        gpus_per_host = {}
        if self.engine_launcher == "ssh":
            progress(f"reaching {len(self.hosts)} hosts over ssh")
            try:
                gpus_per_host = self._other_hosts.prepare(self.workdir.name)
            except HostError as error:
                raise ClusterError(str(error)) from None
        if self.requested_backend == "nccl":
            for host in self.hosts:
                if gpus_per_host.get(host.location, host.ranks) < host.ranks:
                    raise ClusterError(
                        f"nccl needs a GPU per rank: {host.location} runs {host.ranks} ranks "
                        f"and has {gpus_per_host[host.location]} GPUs"
                    )
        profile_dir = self.workdir / "profile"
        (profile_dir / "security").mkdir(parents=True)
        environment = {"IPYTHONDIR": str(self.workdir / "ipython"), **launch_environment(self.workdir)}
        forked = self.engine_launcher == "local"
        if not forked:  # engines on other hosts cannot watch the kernel's PID: a lifeline instead
            self._lifeline = Lifeline(self._controller_address)
            environment[LIFELINE_ENV] = self._lifeline.environment_value
        config = self._launcher_config(environment)
        if forked:  # its import of torch runs while the controller starts
            self._zygote = Zygote(self.workdir, environment)
        elif self.engine_launcher == "ssh":  # one zygote per host, each over one ssh session
            self._other_hosts.start_zygotes(environment, self.workdir)
        self._cluster = ipp.Cluster(
            n=self.n,
            profile_dir=str(profile_dir),
            controller_ip=self._controller_address,
            controller_args=[
                f"--HeartMonitor.period={self.heartbeat_ms}",
                f"--HeartMonitor.max_heartmonitor_misses={self._heartbeat_misses}",
            ],
            engines=self._engine_set_launcher(),
            delay=0,
            # Engines on other hosts get the connection in their environment, not as a copied file.
            send_engines_connection_env=not forked,
            load_profile=False,
            log=CLUSTER_LOG,
            config=config,
        )
        per_host = bool(self._other_hosts.zygotes)
        importing = " while torch is imported, once" + (" per host" if per_host else "")
        progress("starting the controller" + (importing if forked or per_host else ""))
        self._cluster.start_controller_sync()
        if forked:
            self._wait_for_zygote()
        try:
            self._other_hosts.wait_for_zygotes(self.engine_timeout)
        except HostError as error:
            raise ClusterError(str(error)) from None
        self._launch_engines(progress)

    def _wait_for_zygote(self) -> None:
        try:
            self._zygote.wait_ready(self.engine_timeout)
        except ZygoteError as error:
            raise ClusterError(str(error)) from None

    def _engine_set_launcher(self):
        """ipyparallel's engine set launcher: a class, or ipyparallel's name for one."""
        return {"local": ZygoteEngineSetLauncher, "ssh": HostZygoteEngineSetLauncher}.get(
            self.engine_launcher, self.engine_launcher
        )

    def _launcher_config(self, environment: dict[str, str]) -> Config:
        config = Config()
        python = sys.executable if self.engine_launcher == "local" else self.remote_python
        config.EngineLauncher.engine_cmd = [python, "-m", "ddp_magics.engine"]
        # Nobody reads an engine's history; without it, cells can take the notebook's numbers.
        engine_args = ["--HistoryManager.enabled=False"]
        if self.engine_launcher != "local":  # an engine that hears no controller exits after this
            misses = math.ceil(self._silence_ms / (self.heartbeat_ms + ENGINE_HEARTBEAT_CHECK_EXTRA_MS)) + 1
            engine_args.append(f"--IPEngine.max_heartbeat_misses={misses}")
        config.EngineLauncher.engine_args = engine_args
        config.ControllerLauncher.controller_cmd = [sys.executable, "-m", "ddp_magics.controller"]
        config.BaseLauncher.environment = environment
        config.LocalEngineSetLauncher.delay = 0  # ranks follow engine ids, whatever their order
        if self.engine_launcher == "ssh":
            self._other_hosts.configure(config, self.workdir)
        elif self.engine_launcher == "mpi":
            config.MPILauncher.mpi_cmd = self.mpi_command
            if self.hosts:  # MPICH's (hydra's) form
                hosts = ",".join(f"{host.name}:{host.ranks}" for host in self.hosts)
                config.MPILauncher.mpi_args = ["-hosts", hosts]
        # Batch launchers (Slurm, ...) write their job script into the cluster's directory, not
        # into the notebook's (the engines' working directory stays the notebook's).
        config.BatchSystemLauncher.batch_file_name = str(self.workdir / "engines.sbatch")
        config.merge(Config(self.launcher_settings))  # the user's, last: e.g. a Slurm account
        return config

    def _choose_controller_address(self) -> str:
        """Where the controller listens: where asked, else 127.0.0.1 while every engine is on this
        host, else the one address of this host that the hosts are reached from."""
        if self.controller_ip:
            return self.controller_ip
        if self.engine_launcher == "slurm":
            raise ClusterError("--engines slurm needs --ip: an address of this host that the nodes reach")
        remote = {}
        for host in self.hosts:
            address = ipv4_address(host.name)
            if not address.startswith("127."):
                remote[host.location] = rank_code.address_towards(address)
        sources = sorted(set(remote.values()))
        if not sources:
            return LOCAL_HOST
        if len(sources) > 1:
            raise ClusterError(
                f"the hosts are reached from different addresses of this host ({', '.join(sources)}); "
                "name the one the controller listens on with --ip"
            )
        return sources[0]

    def _launch_engines(self, progress: Progress) -> None:
        progress(f"starting {self.n} engines" + (f" on {len(self.hosts)} hosts" if self.hosts else ""))
        self._cluster.start_engines_sync(self.n)
        if self._client is None:
            self._client = self._cluster.connect_client_sync()
        deadline = time.monotonic() + self.engine_timeout
        while (connected := len(self._client.ids)) < self.n:
            progress(f"engines connected: {connected}/{self.n}")
            try:
                self._client.wait_for_engines(
                    connected + 1,
                    timeout=max(deadline - time.monotonic(), 0.001),
                    interactive=False,
                    widget=False,
                )
            except TimeoutError:
                raise ClusterError(
                    f"only {len(self._client.ids)} of {self.n} engines connected "
                    f"within {self.engine_timeout:g} s"
                ) from None
        progress(f"engines connected: {self.n}/{self.n}")

    @property
    def _silence_ms(self) -> float:
        """How long an engine may go unheard before it counts as dead, whatever the period."""
        return HEARTBEAT_SILENCE_MS if self.engine_launcher == "local" else self.link_loss_seconds * 1000

    @property
    def _heartbeat_misses(self) -> int:
        return math.ceil(self._silence_ms / self.heartbeat_ms)

    @property
    def restartable_in_place(self) -> bool:
        """Whether :meth:`restart` can replace the engines alone (while their zygotes live: the
        local one, or each host's)."""
        local_alive = self._zygote is None or self._zygote.alive()
        return self.running and local_alive and self._other_hosts.zygotes_alive()

    def restart(self, progress: Progress | None = None) -> None:
        """Kill the engines (a rank stuck in gloo included) and start new ones that form a new
        process group; the controller stays (and the zygote, so no local engine imports torch
        again, unless the notebook's environment changed since the zygote imported it)."""
        progress = progress or (lambda message: None)
        if not self.restartable_in_place:
            raise ClusterError("this cluster cannot restart its engines in place")
        # Local engines are waited for by PID; others are gone once the controller has seen them go.
        zygote = psutil.Process(self._zygote.process.pid) if self._zygote else None
        old_engines = zygote.children(recursive=True) if zygote else []
        progress(f"stopping the {self.n} engines")
        try:
            _kill_engines(self._client)
            self._cluster.stop_engines_sync()
            _wait_for_exit(old_engines)
            self.ranks = []
            self._views = {}
            if self._zygote is not None and self._zygote.environment_changed():
                progress("the notebook's environment changed: importing torch again in it")
                self._zygote = self._zygote.replacement()
                self._wait_for_zygote()
            self._launch_engines(progress)
            self._form_process_group(progress)
        except BaseException:
            self.stop()
            raise

    def recover(
        self,
        unfinished: CellRun | None,
        shrink: bool = False,
        interrupt_grace: float = 3.0,
        progress: Progress | None = None,
    ) -> Recovery:
        """Bring every rank back to a working default process group, keeping what each living
        rank has defined: cut the old groups' connections (which ends a blocked collective),
        interrupt ranks still running the ``unfinished`` cell, then re-form the group. A dead
        rank is replaced by a new engine under its number, or, with ``shrink``, left out and
        the others renumbered. A ClusterError, with the cluster left as it was, if a rank does
        not stop or no rank lives."""
        progress = progress or (lambda message: None)
        started = time.monotonic()
        dead = self.dead_ranks()
        alive = [rank for rank in range(self.n) if rank not in dead]
        if not alive:
            raise ClusterError("every rank is dead; %dist_restart starts new ones")
        progress("cutting the process groups' connections")
        # Just after a network outage, TCP resends only when its back-off timer fires (up to as
        # long as the outage was): ranks on other hosts get as long as a link may be lost.
        answer_seconds = SIGNAL_SECONDS if self.engine_launcher == "local" else self.link_loss_seconds
        unreachable = self.signal(protocol.CUT_CONNECTIONS_SIGNAL, alive, timeout=answer_seconds)
        if unreachable:
            hosts = sorted({self.ranks[rank].host for rank in unreachable})
            raise ClusterError(
                f"{protocol.rank_label(unreachable)} on {', '.join(hosts)} did not answer within "
                f"{answer_seconds:g} s (host unreachable?); try again once the network is back, or "
                "%dist_restart for new engines"
            )
        interrupted = []
        if unfinished is not None:
            busy = self._busy_after(unfinished, alive, CUT_WAIT_SECONDS)
            if busy:
                stacks = {
                    rank: parse_stack_dump(dump.stack)
                    for rank, dump in self.inspect(unfinished, busy).items()
                }
                # faulthandler answers the cut as it answers a stack dump, and drops a signal that
                # comes while it is writing a dump (a stack-dump request held up by a network
                # outage reaches a rank together with the cut): a rank its dump shows still in a
                # collective gets the cut again, now that its dump is written.
                blocked = [rank for rank in busy if rank in stacks and in_a_collective(stacks[rank])]
                if blocked:
                    self.signal(protocol.CUT_CONNECTIONS_SIGNAL, blocked, timeout=answer_seconds)
                    still = self._busy_after(unfinished, blocked, CUT_WAIT_SECONDS)
                    busy = [rank for rank in busy if rank not in blocked or rank in still]
                # A rank whose collective the cut ended may still be formatting its error (slow on
                # a loaded machine): its stack says so, and it is left to finish.
                interrupted = [
                    rank for rank in busy if rank not in stacks or not formatting_an_error(stacks[rank])
                ]
            if interrupted:
                progress(f"interrupting {protocol.rank_label(interrupted)}")
                self.interrupt(interrupted)
            if busy:
                stuck = self._busy_after(unfinished, alive, interrupt_grace)
                if stuck:
                    self._wait_for_far_answers(unfinished, stuck, interrupt_grace, progress)
        renumbered: dict[int, int] = {}
        if dead and shrink:
            renumbered = {old: new for new, old in enumerate(alive)}
            self.ranks = [dataclasses.replace(self.ranks[old], rank=new) for old, new in renumbered.items()]
            self.n = len(self.ranks)
            self._views = {}
            renumbered = {old: new for old, new in renumbered.items() if old != new}
        elif dead:
            progress(f"starting {len(dead)} engines for {protocol.rank_label(dead)}")
            self._replace_engines(dead)
        progress(f"re-forming the {self.backend} process group")
        new = set() if shrink else set(dead)
        answers = self._join(
            lambda info: rank_code.setup_rank if info.rank in new else rank_code.rejoin_process_group
        )
        rejoined = {rank: answer for rank, answer in answers.items() if isinstance(answer, protocol.Rejoined)}
        return Recovery(
            world_size=self.n,
            replaced=[] if shrink else dead,
            dropped=dead if shrink else [],
            renumbered=renumbered,
            interrupted=interrupted,
            stale={rank: answer.stale for rank, answer in rejoined.items() if answer.stale},
            cut_peers={rank: answer.cut_peers for rank, answer in rejoined.items()},
            seconds=time.monotonic() - started,
        )

    def _wait_for_far_answers(
        self, run: CellRun, stuck: list[int], interrupt_grace: float, progress: Progress
    ) -> None:
        """Ranks still running ``run`` after an interrupt: a ClusterError at once if every engine
        is on this machine. Ranks on other hosts may have stopped while their answer waits for
        a connection to come back after a network outage (TCP resends only after a back-off, up
        to as long as the outage): they get up to ``link_loss_seconds``. (Their stacks cannot
        tell: a stack dump asked for during the outage may arrive only now, taken before the
        cut.)"""
        if self.engine_launcher == "local":
            raise ClusterError(
                f"{protocol.rank_label(stuck)} did not stop within {interrupt_grace:g} s of an "
                "interrupt (stuck in C code that ignores signals?); %dist_restart starts new "
                "engines (every rank's state is lost)"
            )
        hosts = ", ".join(sorted({self.ranks[rank].host for rank in stuck}))
        progress(f"waiting for {protocol.rank_label(stuck)} on {hosts} to answer (a link coming back?)")
        silent = self._busy_after(run, stuck, self.link_loss_seconds)
        if silent:
            raise ClusterError(
                f"{protocol.rank_label(silent)} on {hosts} did not stop within "
                f"{interrupt_grace + self.link_loss_seconds:g} s of an interrupt (stuck in C code that "
                "ignores signals, or still cut off?); try again once the network is back, or "
                "%dist_restart for new engines (every rank's state is lost)"
            )

    def _busy_after(self, run: CellRun, alive: list[int], seconds: float) -> list[int]:
        """The living ranks still running ``run`` after waiting up to ``seconds`` for them."""
        deadline = time.monotonic() + seconds
        while True:
            busy = [rank for rank in run.pending_ranks() if rank in alive]
            if not busy or time.monotonic() > deadline:
                return busy
            time.sleep(0.01)

    def _replace_engines(self, dead: list[int]) -> None:
        """New engines for the ``dead`` ranks, on their hosts, assigned their rank numbers."""
        if not self.restartable_in_place:
            raise ClusterError("the engines' zygote is gone; %dist_restart starts new engines")
        known = {info.engine_id for info in self.ranks}
        if self.engine_launcher == "ssh":
            per_host: dict[str, int] = {}
            listed = {ipv4_address(host.name): host.location for host in self.hosts}
            for rank in dead:
                location = listed[self.ranks[rank].address]
                per_host[location] = per_host.get(location, 0) + 1
            self._cluster.start_engines_sync(len(dead), engines=per_host)
        elif self.engine_launcher == "local":
            self._cluster.start_engines_sync(len(dead))
        else:
            raise ClusterError(
                f"replacing a dead rank is not supported with --engines {self.engine_launcher}: "
                "%dist_recover --shrink goes on without it, %dist_restart starts new engines"
            )
        deadline = time.monotonic() + self.engine_timeout
        while len(fresh := sorted(set(self._client.ids) - known)) < len(dead):
            if time.monotonic() > deadline:
                raise ClusterError(f"the new engines did not connect within {self.engine_timeout:g} s")
            time.sleep(0.02)
        probes = self._within_timeout(
            self._client[fresh].apply_async(rank_code.probe_engine, self._controller_address),
            "importing torch",
        )
        waiting = {rank: self.ranks[rank] for rank in dead}
        for engine_id, probe in zip(fresh, probes):
            rank = next((r for r, info in waiting.items() if info.address == probe.address), None)
            if rank is None:
                raise ClusterError(f"a new engine started on {probe.host}, where no dead rank was")
            info = waiting.pop(rank)
            self.ranks[rank] = dataclasses.replace(info, engine_id=engine_id, pid=probe.pid, host=probe.host)
        self._views = {}

    def _setups(self) -> list[protocol.RankSetup]:
        """What makes each engine of ``self.ranks`` its rank (before rank 0's store listens)."""
        addresses = [info.address for info in self.ranks]
        host_order = list(dict.fromkeys(addresses))
        return [
            protocol.RankSetup(
                rank=info.rank,
                local_rank=info.local_rank,
                world_size=self.n,
                master_addr=addresses[0],  # 127.0.0.1 on one host; else rank 0's host's address
                master_port=0,
                backend=self.backend,
                device=info.device,
                timeout_s=self.pg_timeout,
                group_rank=host_order.index(info.address),
                group_world_size=len(host_order),
                local_world_size=addresses.count(info.address),
                address=info.address if len(host_order) > 1 else None,
            )
            for info in self.ranks
        ]

    def _join(self, joiner: Callable[[RankInfo], Callable]) -> dict[int, object]:
        """Rank 0 opens a new rendezvous, then every rank runs ``joiner(info)(its setup)``;
        each rank's answer."""
        setups = self._setups()
        gone = [info.rank for info in self.ranks if info.engine_id not in self._client.ids]
        if gone:
            raise ClusterError(
                f"{protocol.rank_label(gone)} died (or lost its link to this machine) just now; "
                "%dist_recover again replaces it, %dist_restart starts new engines"
            )
        rank0 = self._client[self.ranks[0].engine_id]
        opening = rank0.apply_async(rank_code.open_rendezvous, setups[0])
        port = self._within_timeout(opening, "opening rank 0's store")
        setups = [dataclasses.replace(setup, master_port=port) for setup in setups]
        pending = [
            self._client[info.engine_id].apply_async(joiner(info), setup)
            for info, setup in zip(self.ranks, setups)
        ]
        return {
            info.rank: self._within_timeout(result, f"rank {info.rank} joining the process group")
            for info, result in zip(self.ranks, pending)
        }

    def _form_process_group(self, progress: Progress) -> None:
        engine_ids = sorted(self._client.ids)[: self.n]
        progress("importing torch on the engines")
        probes = self._within_timeout(
            self._client[engine_ids].apply_async(rank_code.probe_engine, self._controller_address),
            "importing torch",
        )
        engine_ids, probes = self._host_by_host(engine_ids, probes)
        hosts = [probe.address for probe in probes]
        host_order = list(dict.fromkeys(hosts))
        local_ranks = [hosts[:index].count(host) for index, host in enumerate(hosts)]
        gpus = [int(probe.gpu_count > local) for probe, local in zip(probes, local_ranks)]
        self.backend = resolve_backend(self.requested_backend, gpus)
        if self.backend == "nccl" and not all(gpus):
            missing = [rank for rank, has_gpu in enumerate(gpus) if not has_gpu]
            raise ClusterError(f"nccl needs a GPU for every rank; ranks {_format_ranks(missing)} have none")
        self.ranks = [
            RankInfo(
                rank=rank,
                engine_id=engine_id,
                host=probe.host,
                pid=probe.pid,
                local_rank=local_rank,
                device=f"cuda:{local_rank}" if self.backend == "nccl" else "cpu",
                address=probe.address,
                group_rank=host_order.index(probe.address),
            )
            for rank, (engine_id, probe, local_rank) in enumerate(zip(engine_ids, probes, local_ranks))
        ]
        progress(f"forming the {self.backend} process group")
        self._join(lambda info: rank_code.setup_rank)

    def _host_by_host(self, engine_ids: list[int], probes: list) -> tuple[list[int], list]:
        """Engines ordered host by host (in the order of the host list), by engine id within a host."""
        listed = [ipv4_address(host.name) for host in self.hosts]
        addresses = [probe.address for probe in probes]
        first_seen = list(dict.fromkeys(addresses))

        def host_place(address: str) -> tuple[int, int]:
            if address in listed:
                return (listed.index(address), 0)
            return (len(listed), first_seen.index(address))

        order = sorted(range(len(probes)), key=lambda i: (host_place(addresses[i]), engine_ids[i]))
        return [engine_ids[i] for i in order], [probes[i] for i in order]

    def _within_timeout(self, result: ipp.AsyncResult, doing: str):
        """The result, or a ClusterError if the engines take longer than ``engine_timeout``."""
        try:
            return result.get(timeout=self.engine_timeout)
        except TimeoutError:
            raise ClusterError(f"engines still busy {doing} after {self.engine_timeout:g} s") from None
        except CompositeError as error:
            engine_ranks = {info.engine_id: info.rank for info in self.ranks}
            died = [
                engine_ranks.get(engine_info.get("engine_id"))
                for ename, _, _, engine_info in error.elist
                if ename == "EngineError"
            ]
            if not died:
                raise
            known = sorted(rank for rank in died if rank is not None)
            who = protocol.rank_label(known) if known else f"{len(died)} new engine(s)"
            raise ClusterError(f"{who} died while {doing}") from None

    def stop(self) -> None:
        """Stop controller and engines and remove the cluster's files. Safe to call twice."""
        cluster, client, zygote = self._cluster, self._client, self._zygote
        self._cluster = self._client = self._zygote = None
        processes = cluster_processes(self.workdir) if self.workdir is not None else []
        try:
            if cluster is not None:
                _kill_engines(client)
                cluster.stop_cluster_sync()
            if zygote is not None:
                zygote.stop()
            _wait_for_exit(processes)
        finally:
            self._other_hosts.stop()
            if self._lifeline is not None:
                self._lifeline.close()
                self._lifeline = None
            if client is not None:
                client.close()
            if self.workdir is not None:
                shutil.rmtree(self.workdir, ignore_errors=True)
                self.workdir = None
            self.ranks = []
            self._views = {}

    def processes(self) -> list[psutil.Process]:
        """Controller, engines and their helper processes (nannies, schedulers) now running."""
        if self._cluster is None:
            return []
        return cluster_processes(self.workdir)

    # ------------------------------------------------------------------- state
    def engine_ids(self, ranks: Iterable[int] | None = None) -> list[int]:
        chosen = range(self.n) if ranks is None else ranks
        return [self.ranks[rank].engine_id for rank in chosen]

    def dead_ranks(self) -> list[int]:
        connected = set(self._client.ids) if self._client is not None else set()
        return [
            info.rank
            for info in self.ranks
            if info.engine_id not in connected or not self._rank_process_alive(info)
        ]

    def _rank_process_alive(self, info: RankInfo) -> bool:
        return info.host != _this_host() or process_alive(info.pid)

    def death_record(self, rank: int, wait: float = DEATH_RECORD_SECONDS) -> tuple[str | None, str | None]:
        """How a dead rank's engine ended (``killed by SIGSEGV (Segmentation fault)``) and the
        stack Python wrote as it crashed (faulthandler's, from the engine's log), as far as this
        machine can tell: for engines its zygote forked. (None, None) otherwise."""
        if self._zygote is None or self.workdir is None:
            return None, None
        pid = self.ranks[rank].pid
        marker = f"{ENDED_PREFIX}{pid} "
        deadline = time.monotonic() + wait  # the zygote reaps and logs the exit just after it
        how = None
        while how is None:
            lines = self._zygote.log_path.read_text(errors="replace").splitlines()
            how = next((line[len(marker) :] for line in lines if line.startswith(marker)), None)
            if how is None and time.monotonic() > deadline:
                break
            time.sleep(0.02)
        return how, self._crash_dump(pid)

    def _crash_dump(self, pid: int) -> str | None:
        for log in (self.workdir / "profile" / "log").glob("ipengine-*.log"):
            text = log.read_text(errors="replace")
            if f"pid={pid}," in text and "Fatal Python error" in text:
                return text[text.rindex("Fatal Python error") :]
        return None

    def status(self) -> list[RankStatus]:
        dead = set(self.dead_ranks())
        return [RankStatus(info=info, alive=info.rank not in dead) for info in self.ranks]

    # ------------------------------------------------------------------- running
    def _view(self, ranks: list[int]) -> ipp.DirectView:
        key = tuple(ranks)
        if key not in self._views:
            self._views[key] = self._client[self.engine_ids(ranks)]
        return self._views[key]

    def execute(self, code: str, ranks: list[int], cell_number: int) -> CellRun:
        """Start running ``code`` on ``ranks`` as the notebook's cell ``cell_number``; returns at once."""
        numbered = protocol.numbered_cell(code, cell_number)
        return CellRun(self._view(ranks).execute(numbered, silent=False, block=False), ranks)

    def push(self, namespace: dict) -> None:
        self._client[self.engine_ids()].push(namespace, block=True)

    def pull(self, name: str) -> dict[int, object]:
        """``{rank: value of name}``; a ClusterError if ``name`` is defined on no rank or only some."""
        try:
            values = self._client[self.engine_ids()].pull(name, block=True)
        except CompositeError as error:
            if {ename for ename, *_ in error.elist} == {"NameError"}:
                raise ClusterError(f"{name!r} is not defined on every rank") from None
            raise
        return dict(enumerate(values))

    def call(self, ranks: list[int], function: Callable, *args) -> dict[int, object]:
        """``function(*args)`` on each of ``ranks`` (idle ones), ``{rank: result}``; a ClusterError
        naming the first rank that raised, with its exception in one line."""
        results = self._view(ranks).apply_async(function, *args)
        try:
            values = self._within_timeout(results, f"running {function.__name__}")
        except CompositeError as error:
            engine_ranks = {info.engine_id: info.rank for info in self.ranks}
            ename, evalue, _, engine_info = error.elist[0]
            rank = engine_ranks.get(engine_info.get("engine_id"), "?")
            raise ClusterError(f"rank {rank}: {ename}: {evalue}") from None
        except RemoteError as error:
            raise ClusterError(f"rank {ranks[0]}: {error.ename}: {error.evalue}") from None
        return dict(zip(ranks, values if isinstance(values, list) else [values]))

    def start_post_mortem(self, rank: int) -> str:
        """Open pdb where ``rank``'s last cell raised; what pdb shows first (a ClusterError if no
        cell raised there)."""
        opened, shown = self.call([rank], debugging.start_post_mortem)[rank]
        if not opened:
            raise ClusterError(f"rank {rank}: {shown}")
        return shown

    def post_mortem_commands(self, rank: int, commands: list[str]) -> tuple[str, bool]:
        """Run pdb commands in ``rank``'s open post-mortem: what they printed, whether it is still open."""
        return self.call([rank], debugging.post_mortem_commands, commands)[rank]

    def end_post_mortem(self, rank: int) -> None:
        self.call([rank], debugging.end_post_mortem)

    def snapshots(self, ranks: list[int], expression: str) -> dict[int, protocol.ValueSnapshot]:
        """``expression`` evaluated on each of ``ranks``, as values to compare (``%dist_diff``); a
        ClusterError naming the first rank where it raised."""
        answers = self.call(ranks, debugging.snapshot, expression)
        for rank, answer in answers.items():
            if isinstance(answer, str):
                raise ClusterError(f"rank {rank}: {answer}")
        return answers

    def debugger_input(self, rank: int, line: str) -> None:
        """Hand ``line`` to ``rank``'s pdb, waiting at a prompt in ``breakpoint()``: a control
        message (the rank's main thread is in the cell), which ipyparallel's client sends only
        through its own method for its control requests; there is no public one for others."""
        sent = self._client._send_control_request(
            targets=[self.ranks[rank].engine_id],
            msg_type=protocol.DEBUGGER_INPUT_REQUEST,
            content={"line": line},
            block=False,
        )
        try:
            sent.result(timeout=SIGNAL_SECONDS)
        except TimeoutError:
            raise ClusterError(f"rank {rank} took no debugger line within {SIGNAL_SECONDS:g} s") from None

    def interrupt(self, ranks: list[int]) -> list[int]:
        """SIGINT to ``ranks``; those whose engine did not confirm it (see :meth:`signal`)."""
        return self.signal(signal.SIGINT, ranks)

    def signal(self, signum: int, ranks: list[int], timeout: float = SIGNAL_SECONDS) -> list[int]:
        """Send ``signum`` to the engines of ``ranks`` through their nannies (on any host); the
        ranks whose nanny did not confirm within ``timeout`` (its host unreachable)."""
        sent = {
            rank: self._client.send_signal(signum, targets=[self.ranks[rank].engine_id], block=False)
            for rank in ranks
        }
        deadline = time.monotonic() + timeout
        for future in sent.values():
            with contextlib.suppress(TimeoutError):
                future.result(timeout=max(deadline - time.monotonic(), 0))
        return [rank for rank, future in sent.items() if not future.done()]

    # ------------------------------------------------------------------- inspecting
    def start_trace(self, ranks: list[int], values_limit: int) -> None:
        """Trace the next cell sent to ``ranks``; a ClusterError if a rank could not start it."""
        try:
            starting = self._view(ranks).apply_async(recorder.start_trace, values_limit)
            self._within_timeout(starting, "starting a trace")
        except CompositeError as error:
            engine_ranks = {info.engine_id: info.rank for info in self.ranks}
            failures = [
                f"rank {engine_ranks.get(engine_info.get('engine_id'), '?')}: {ename}: {evalue}"
                for ename, evalue, _, engine_info in error.elist
            ]
            raise ClusterError("tracing could not start (" + "; ".join(failures) + ")") from None

    def inspect(self, run: CellRun, ranks: list[int], wait: float = 3.0) -> dict[int, protocol.Inspection]:
        """Where ``ranks``, still running ``run``, are: every thread's stack and the calls traced
        so far, even while blocked in C code (see :mod:`ddp_magics.engine.inspector`). Ranks that
        do not answer within ``wait`` seconds are left out."""
        before = {rank: run.published(rank, protocol.INSPECTION_KEY) for rank in ranks}
        self.signal(protocol.STACK_DUMP_SIGNAL, ranks, timeout=wait)
        answers: dict[int, protocol.Inspection] = {}
        deadline = time.monotonic() + wait
        while len(answers) < len(ranks) and time.monotonic() < deadline:
            for rank in ranks:
                answer = run.published(rank, protocol.INSPECTION_KEY)
                if answer is not None and answer is not before[rank]:
                    answers[rank] = answer
            time.sleep(0.01)
        return answers


# ------------------------------------------------------------------ stray clusters
def clusters_root() -> Path:
    """The directory of this user's clusters; UnsafeDirectory if it is not private to this user."""
    return private_root(CLUSTERS_ROOT_NAME)


def _write_owner(workdir: Path) -> None:
    write_atomically(workdir / OWNER_FILE, f"{Owner.this_process()}\n{_this_host()}\n")


def stop_stray_clusters() -> list[str]:
    """Remove the clusters whose owning kernel is gone.

    Their processes normally ended with their owner (see :mod:`ddp_magics.lifetime`); any
    still running (started by an older version, or stuck) are stopped by PID. A cluster of a
    kernel on another machine (a temp directory shared over the network) is left alone.
    Returns one line per cluster that needed more than removing its files: what was stopped,
    or why it could not be cleaned up. Never raises; a clusters' directory that is not this
    user's own holds nothing of this user's to clean (and :meth:`RankCluster.start` refuses it).
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
        if not owner.on_this_machine and host.strip() != _this_host():
            return []  # another machine's kernel, which alone can tell whether it still runs
        if owner.alive():
            return []
    reports = []
    processes = cluster_processes(workdir)
    if processes:
        _wait_for_exit(processes, grace=0)
        reports.append(f"stopped {len(processes)} processes of {workdir.name}, whose kernel had ended")
    shutil.rmtree(workdir, ignore_errors=True)
    if workdir.exists():
        reports.append(f"could not remove {workdir}")
    return reports


def _kill_engines(client: ipp.Client | None) -> None:
    """SIGKILL every engine. Engines hold nothing to save, and one blocked in gloo ignores
    SIGTERM. Killed (through its nanny) while the controller runs, each engine's nanny tells the
    controller and exits at once; with the controller gone it would linger seconds trying."""
    if client is not None and client.ids:
        client.send_signal(signal.SIGKILL, targets=client.ids, block=False)
        _wait_until_unregistered(client, timeout=STOP_GRACE_SECONDS)


def _wait_until_unregistered(client: ipp.Client, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while client.ids and time.monotonic() < deadline:
        time.sleep(0.01)


def _wait_for_exit(
    processes: list[psutil.Process], grace: float = STOP_GRACE_SECONDS, timeout: float = 3.0
) -> None:
    """Make sure stopped processes exit, by PID: SIGKILL those still running after ``grace``
    seconds (all are ours and hold nothing to save)."""
    kill_now(wait_for_exit(processes, timeout=grace))
    wait_for_exit(processes, timeout=timeout)


def ipv4_address(host: str) -> str:
    """``host``'s IPv4 address (the name resolved here); ClusterError if it has none."""
    try:
        return socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except socket.gaierror as error:
        raise ClusterError(f"unknown host {host!r}: {error.strerror}") from None
    except UnicodeError:  # a label longer than DNS allows
        raise ClusterError(f"unknown host {host!r}: not a valid host name") from None


def _mpiexec() -> str:
    """The mpiexec next to this python (the ``mpi`` extra's MPICH), else the one on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else "mpiexec"


def _this_host() -> str:
    return socket.gethostname()


def _format_ranks(ranks: list[int]) -> str:
    return ",".join(str(rank) for rank in ranks)
