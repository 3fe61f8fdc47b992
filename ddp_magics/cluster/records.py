"""The cluster's plain records and its vocabulary: what it is asked to be (:class:`ClusterConfig`),
what it knows of its ranks, and what it answers (outputs, failures, recoveries). Plain data, so
they can be shown, compared and tested apart from a running cluster."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

BACKENDS = ("auto", "gloo", "nccl")
# ipyparallel's names for its engine launchers that ddp_magics knows how to set up.
LAUNCHERS = ("local", "ssh", "mpi", "slurm")
LOCAL_HOST = "127.0.0.1"
# This much silence means dead whatever the heartbeat period (for engines on this machine: those on
# other hosts get ``link_loss_tolerance``).
HEARTBEAT_SILENCE_MS = 3000
# An idle cluster is parked (its ranks stopped, cluster/parking.py) after this many seconds unused.
IDLE_PARK_SECONDS = 120.0
# How long engines may take to start, import torch, or answer a set-up call.
ENGINE_TIMEOUT_SECONDS = 60.0
TEXT_ONLY_MIMETYPES = {"text/plain"}
# Where a long operation (start, restart, recover) reports each step it begins, in words.
Progress = Callable[[str], None]


# What can get the user past a ClusterError, in the cluster's words; the notebook side says how
# (ddp_magics.errors.WAYS_OUT).
RESTART, RECOVER_AGAIN, SHRINK = "restart", "recover again", "shrink"


class ClusterError(RuntimeError):
    """The cluster could not do what was asked (start, reach a rank, ...); ``ways_out``: what
    can get past it (RESTART, RECOVER_AGAIN, SHRINK)."""

    def __init__(self, message: str, *ways_out: str) -> None:
        super().__init__(message)
        self.ways_out = ways_out


class GroupBroken(ClusterError):
    """A recovery failed after it had cut the old process groups: the ranks are no longer one
    working group, and the cluster refuses cells until a recovery or a restart succeeds."""


class DeadRanks(ClusterError):
    """Ranks whose engine process is gone: nothing runs until they are replaced."""

    def __init__(self, ranks: list[int]) -> None:
        super().__init__(f"ranks {ranks} died")
        self.ranks = ranks


@dataclass(frozen=True)
class HostSpec:
    """One entry of a host list: ``[user@]name[:port]`` (ipyparallel's SSH form) and its ranks."""

    location: str
    ranks: int
    address: str = ""  # its IPv4 address as resolved here, once (ddp_magics.arguments)

    @property
    def name(self) -> str:
        return self.location.rpartition("@")[2].partition(":")[0]

    @property
    def ssh_target(self) -> list[str]:
        """``ssh`` arguments that reach it: options, then ``--``, then the destination (so that no
        host name is ever read as an option)."""
        user, _, host = self.location.rpartition("@")
        name, _, port = host.partition(":")
        return [*(["-p", port] if port else []), "--", f"{user}@{name}" if user else name]


@dataclass(frozen=True)
class ClusterConfig:
    """What a cluster is to be, checked once by :mod:`ddp_magics.arguments` from the user's
    options and the magics' settings (which hold every default)."""

    n: int
    backend: str  # one of BACKENDS
    process_group_timeout: float
    engines: str  # one of LAUNCHERS
    hosts: tuple[HostSpec, ...]  # with their addresses resolved; empty for this machine only
    controller_ip: str | None
    heartbeat_ms: int
    # Engines on other hosts may go unheard this long (a network blip) before they count as
    # dead, on the controller's side and on their own (ipyparallel's engine exits then).
    link_loss_tolerance: float
    ssh_command: tuple[str, ...]
    remote_python: str
    mpi_command: tuple[str, ...]
    launcher_settings: dict = field(hash=False)
    # Seconds unused before the cluster is parked (None: never); settings.park_idle_after.
    park_after: float | None = IDLE_PARK_SECONDS


def nccl_shortfall(where: str, ranks: int, gpus: int) -> str | None:
    """NCCL's one rule: a GPU per rank. Why ``where`` cannot run ``ranks`` ranks with ``gpus``
    GPUs, or None."""
    if gpus >= ranks:
        return None
    return f"nccl needs a GPU per rank: {where} runs {ranks} ranks and has {gpus} GPUs"


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
class RankStatus:
    info: RankInfo
    alive: bool


@dataclass(frozen=True)
class Recovery:
    """What a recovery did."""

    world_size: int
    replaced: list[int]  # ranks whose dead engine a new one (with nothing defined yet) replaced
    dropped: list[int]  # old numbers of the dead ranks a shrink left out
    renumbered: dict[int, int]  # old rank -> new rank, for the ranks a shrink renumbered
    interrupted: list[int]  # ranks that were running Python of their own, interrupted
    stale: dict[int, tuple[tuple[str, str], ...]]  # per rank: names that hold an old group
    cut_peers: dict[int, frozenset[str]]  # per rank: the peers of the old groups' connections


@dataclass(frozen=True)
class RankFailure:
    """A rank's exception in a cell, as plain data."""

    rank: int
    ename: str
    evalue: str
    traceback: str
    engine_died: bool = False  # ipyparallel's EngineError: the rank's process ended


@dataclass
class RankOutput:
    """Everything one rank produced in one cell, as plain data."""

    rank: int
    stdout: str = ""
    stderr: str = ""
    result: dict | None = None  # the last expression's mimebundle
    displays: list[dict] = field(default_factory=list)  # {"data": ..., "metadata": ...}

    @property
    def rich_displays(self) -> list[dict]:
        """Displays, plus a last-expression value that is more than text (e.g. a figure)."""
        if self.result and set(self.result) - TEXT_ONLY_MIMETYPES:
            return [*self.displays, {"data": self.result, "metadata": {}}]
        return self.displays

    @property
    def result_text(self) -> str:
        if self.result and not set(self.result) - TEXT_ONLY_MIMETYPES:
            return self.result.get("text/plain", "")
        return ""

    def is_empty(self) -> bool:
        return not (self.stdout or self.stderr or self.result or self.displays)

    def signature(self) -> tuple:
        """Equal signatures mean the ranks' outputs can share one block."""
        displays = tuple(
            tuple(sorted((key, str(value)) for key, value in item["data"].items()))
            for item in self.rich_displays
        )
        return (self.stdout, self.stderr, self.result_text, displays)
