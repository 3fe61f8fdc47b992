"""The magics: %dist_start, %%distributed, %dist_status, %dist_push, %dist_pull,
%dist_restart and %dist_stop. They turn the user's words into RankCluster calls."""

from __future__ import annotations

import atexit
import html
import ipaddress
import keyword
import math
import os
import re
import socket
import sys
import time
from collections.abc import Callable

from IPython.core.error import StdinNotImplementedError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from IPython.display import display
from traitlets import Bool, Dict, Enum, Float, Integer, List, TraitError, Unicode, validate

from ddp_magics import cluster as cluster_module
from ddp_magics.cluster import (
    BACKENDS,
    LAUNCHERS,
    CellRun,
    ClusterError,
    HostSpec,
    Progress,
    RankCluster,
    Recovery,
)
from ddp_magics.diagrams import Trace
from ddp_magics.diff import describe_differences
from ddp_magics.errors import (
    RESTART_ADVICE,
    DeadRank,
    DistributedCellError,
    failure_from_remote_error,
    stale_group_failure,
    usage_error,
)
from ddp_magics.live_view import LiveView
from ddp_magics.output import StatusTable, live_html, render
from ddp_magics.protocol import SKIP_BREAKPOINTS, TRACE_KEY, format_ranks, rank_label
from ddp_magics.stacks import BlockedRank

POLL_SECONDS = 0.1
LIVE_REFRESH_SECONDS = 0.5
LIVE_TAIL_LINES = 12
# A finished rank's trace is sent as its cell ends; its reply can overtake it by milliseconds.
TRACE_ARRIVAL_SECONDS = 2.0
ENDED_DONE, ENDED_TIMEOUT, ENDED_AFTER_ERROR, ENDED_INTERRUPT = "done", "timeout", "error", "interrupt"


_RANK_RANGE = re.compile(r"\s*(-?[0-9]+)\s*(?:-\s*(-?[0-9]+)\s*)?")


def parse_rank_spec(spec: str, world_size: int) -> list[int]:
    """``0``, ``0,2``, ``1-3`` or a mix like ``0,2-3`` -> sorted ranks; UsageError if invalid."""
    ranks: set[int] = set()
    for part in spec.split(","):
        match = _RANK_RANGE.fullmatch(part)
        try:
            low = int(match[1])
            high = int(match[2]) if match[2] else low
        except (TypeError, ValueError):  # no match, or more digits than int() reads
            raise usage_error(f"--ranks {spec!r}: expected ranks like 0, 0,2 or 1-3") from None
        if low > high:
            raise usage_error(f"--ranks {spec!r}: {low}-{high} is an empty range")
        if low < 0 or high >= world_size:
            outside = low if low < 0 else high
            raise usage_error(
                f"--ranks {spec!r}: rank {outside} does not exist; "
                f"this cluster has ranks {format_ranks(list(range(world_size)))}"
            )
        ranks.update(range(low, high + 1))
    return sorted(ranks)


# torch keeps timeouts in milliseconds; nobody waits a month for a collective or a cell.
MAX_TIMEOUT_SECONDS = 30 * 24 * 3600
MAX_WORLD_SIZE = 65536


def timeout_problem(seconds: float) -> str | None:
    """Why ``seconds`` is not a usable timeout, or None."""
    if math.isfinite(seconds) and 0 < seconds <= MAX_TIMEOUT_SECONDS:
        return None
    return f"must be more than 0 seconds and at most {MAX_TIMEOUT_SECONDS} (30 days)"


def checked_timeout(option: str, seconds: float) -> float:
    """``seconds`` if it is a usable timeout; UsageError naming ``option`` otherwise."""
    problem = timeout_problem(seconds)
    if problem:
        raise usage_error(f"{option} {seconds:g}: {problem}")
    return seconds


def local_addresses() -> list[str]:
    """This machine's IPv4 addresses (in the kernel's network namespace)."""
    import psutil

    entries = [entry for interface in psutil.net_if_addrs().values() for entry in interface]
    return sorted({entry.address for entry in entries if entry.family == socket.AF_INET})


def is_local_address(address: str) -> bool:
    return address.startswith("127.") or address in local_addresses()


def is_variable_name(name: str) -> bool:
    return name.isidentifier() and not keyword.iskeyword(name)


def _traced_call(trace: Trace | None, rank: int) -> str | None:
    """``recv from rank 1`` for a rank blocked in a traced call."""
    event = trace.in_progress(rank) if trace else None
    return event.call() if event else None


# ``[user@]host[:port]``: names of letters, digits, ``.``, ``_`` and ``-``, none starting with
# ``-`` (ssh would read it as an option); nothing a shell would interpret.
_NAME = r"[A-Za-z0-9_.][A-Za-z0-9_.-]*"
SSH_LOCATION = re.compile(rf"(?:{_NAME}@)?{_NAME}(?::[0-9]{{1,5}})?")
MAX_RANKS_PER_HOST = 1024


def parse_hosts(spec: str) -> list[HostSpec]:
    """``nodeA:2,nodeB:2`` (``[user@]host[:ranks]``, 1 rank if not given) -> host specs in
    rank order; UsageError if malformed, if a host would be read as an ssh option or by a
    shell, or if a host comes twice."""
    hosts: list[HostSpec] = []
    for part in spec.split(","):
        location, colon, count = part.strip().rpartition(":")
        if not colon:
            location, count = count, "1"
        if not location or not re.fullmatch("[0-9]+", count) or not 1 <= int(count) <= MAX_RANKS_PER_HOST:
            raise usage_error(f"--hosts {spec!r}: expected hosts like nodeA:2,nodeB:2 (host:ranks)")
        if not SSH_LOCATION.fullmatch(location) or not 0 < int(location.partition(":")[2] or 1) < 65536:
            raise usage_error(
                f"--hosts: {location!r} is not [user@]host[:port] made of letters, digits, '.', '_' "
                "and '-' (not starting with '-')"
            )
        hosts.append(HostSpec(location, int(count)))
    names = [host.name.lower() for host in hosts]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise usage_error(f"--hosts {spec!r}: {', '.join(twice)} given twice; list each host once")
    return hosts


def host_addresses(hosts: list[HostSpec]) -> list[str]:
    """Each host's IPv4 address, resolved here; UsageError for an unknown host or for two hosts
    that are one (``localhost`` and ``127.0.0.1``): ranks are placed by address."""
    try:
        addresses = [cluster_module.ipv4_address(host.name) for host in hosts]
    except ClusterError as error:
        raise usage_error(f"--hosts: {error}") from None
    for i, address in enumerate(addresses):
        if address in addresses[:i]:
            first = hosts[addresses.index(address)].name
            raise usage_error(
                f"--hosts: {first} and {hosts[i].name} are the same host ({address}); list each host once"
            )
    return addresses


def recovery_report(recovery: Recovery, backend: str) -> str:
    """What %dist_recover did and what the user must redo, in a few lines."""
    lines = [
        f"Recovered: a new {backend} process group of "
        f"{recovery.world_size} ranks; every living rank kept its variables."
    ]
    if recovery.interrupted:
        lines.append(
            f"{rank_label(recovery.interrupted)}: still running after the cut, so interrupted."
        )
    if recovery.replaced:
        label = rank_label(recovery.replaced)
        lines.append(
            f"{label} died and {'was' if len(recovery.replaced) == 1 else 'were'} replaced by a new "
            f"engine with nothing defined: run your set-up cells again on it "
            f"(%%distributed --ranks {','.join(map(str, recovery.replaced))}), then copy the state from "
            "a healthy rank, e.g. `for t in model.state_dict().values(): dist.broadcast(t, src=0)`."
        )
    if recovery.dropped:
        moved = ", ".join(f"{old} is now {new}" for old, new in recovery.renumbered.items())
        lines.append(
            f"Went on without {rank_label(recovery.dropped)}"
            + (f"; rank {moved}" if moved else "")
            + ": `rank` and `world_size` are updated on every rank."
        )
    by_names: dict[tuple[tuple[str, str], ...], list[int]] = {}
    for rank, names in recovery.stale.items():
        by_names.setdefault(names, []).append(rank)
    for names, ranks in by_names.items():
        listed = ", ".join(f"{name} ({kind})" for name, kind in names)
        verb, them = ("holds", "it") if len(names) == 1 else ("hold", "them")
        lines.append(
            f"Stale on {rank_label(ranks)}: {listed} {verb} the old process group; make {them} again "
            f"(dist.new_group, DDP(...), ...) before using {them}."
        )
    return "\n".join(lines)


@magics_class
class DistributedMagics(Magics):
    """Run cells on the ranks of a torch.distributed process group."""

    default_world_size = Integer(
        None,
        allow_none=True,
        config=True,
        help="Ranks %dist_start starts without -n (default: visible GPUs, else 2).",
    )
    backend = Enum(BACKENDS, "auto", config=True, help="Backend %dist_start uses without --backend.")
    cell_timeout = Float(
        60.0, config=True, help="Seconds a %%distributed cell may run before its ranks are reported."
    )
    process_group_timeout = Float(
        1800.0, config=True, help="torch.distributed timeout for collectives (seconds)."
    )
    error_grace = Float(
        5.0,
        config=True,
        help="After a rank raises, seconds to wait for the other ranks before reporting where they are.",
    )
    interrupt_grace = Float(
        3.0, config=True, help="Seconds interrupted ranks get to stop before being reported."
    )
    collapse_identical = Bool(
        True, config=True, help="Show ranks with identical output as one block ([ranks 0-3])."
    )
    max_output_lines = Integer(
        200, config=True, help="Lines kept per rank and stream; earlier ones are counted, not shown."
    )
    live_view_after = Float(
        1.0, config=True, help="Seconds after which a running cell shows its ranks' progress."
    )
    heartbeat_ms = Integer(
        100,
        config=True,
        help="ipyparallel heartbeat period (ms); an engine silent for 3 s is dead whatever the period.",
    )
    link_loss_tolerance = Float(
        30.0,
        config=True,
        help="Seconds ranks on other hosts may go unheard (a network blip) before they count as dead "
        "(their lifeline to the kernel ends them after about 30 s without a link anyway).",
    )
    trace_values_limit = Integer(
        16, config=True, help="Traced tensors with at most this many elements keep their values."
    )
    max_local_ranks = Integer(
        max(64, 8 * (os.cpu_count() or 1)),
        config=True,
        help="Most ranks %dist_start runs on this machine (local engines), each a Python process with torch.",
    )
    engines = Enum(
        LAUNCHERS,
        "local",
        config=True,
        help="ipyparallel engine launcher %dist_start uses without --engines: local, ssh, mpi, slurm.",
    )
    controller_ip = Unicode(
        None,
        allow_none=True,
        config=True,
        help="Address the controller listens on without --ip (default: 127.0.0.1 for local "
        "engines, else the address of this host that the hosts are reached from).",
    )
    ssh_command = List(Unicode(), ["ssh"], config=True, help="ssh command (and options) for --engines ssh.")
    remote_python = Unicode(
        sys.executable,
        config=True,
        help="Python that runs the engines on other hosts (by default this one's path).",
    )
    launcher_settings = Dict(
        config=True,
        help="ipyparallel launcher settings, by class: "
        "{'SlurmEngineSetLauncher': {'account': 'proj', 'timelimit': '1:00:00'}}.",
    )
    mpi_command = List(
        Unicode(), [], config=True, help="mpiexec command for --engines mpi (default: the mpi extra's MPICH)."
    )

    @validate("cell_timeout", "process_group_timeout", "link_loss_tolerance")
    def _usable_timeout(self, proposal):
        problem = timeout_problem(proposal.value)
        if problem:
            raise TraitError(f"DistributedMagics.{proposal.trait.name} = {proposal.value!r}: {problem}")
        return proposal.value

    @validate("error_grace", "interrupt_grace", "live_view_after")
    def _usable_wait(self, proposal):
        if not (math.isfinite(proposal.value) and 0 <= proposal.value <= MAX_TIMEOUT_SECONDS):
            raise TraitError(
                f"DistributedMagics.{proposal.trait.name} = {proposal.value!r}: must be from 0 seconds "
                f"to {MAX_TIMEOUT_SECONDS} (30 days)"
            )
        return proposal.value

    @validate(
        "default_world_size", "max_local_ranks", "heartbeat_ms", "max_output_lines", "trace_values_limit"
    )
    def _count_in_range(self, proposal):
        low, high = {
            "default_world_size": (1, MAX_WORLD_SIZE),
            "max_local_ranks": (1, MAX_WORLD_SIZE),
            "heartbeat_ms": (10, cluster_module.HEARTBEAT_SILENCE_MS),
            "max_output_lines": (0, None),
            "trace_values_limit": (0, None),
        }[proposal.trait.name]
        value = proposal.value
        if value is not None and not (low <= value and (high is None or value <= high)):
            limits = f"from {low} to {high}" if high is not None else f"at least {low}"
            raise TraitError(f"DistributedMagics.{proposal.trait.name} = {value!r}: must be {limits}")
        return value

    def __init__(self, shell=None, **kwargs) -> None:
        super().__init__(shell=shell, **kwargs)
        self.cluster: RankCluster | None = None
        self._restart_failed = False  # the last %dist_restart failed, stopping the cluster
        self._last_raised: list[int] = []  # the ranks that raised in the last cell that failed
        self._unfinished: CellRun | None = None
        self._last_config: dict | None = None
        # The last %dist_recover's: per rank, names holding a destroyed group; the ends of the
        # connections it cut (on every rank).
        self._stale: dict[int, tuple[tuple[str, str], ...]] = {}
        self._cut_peers: frozenset[str] = frozenset()

    # ------------------------------------------------------------------ lifecycle
    @magic_arguments()
    @argument("-n", type=int, default=None, help="number of ranks (default: GPUs, else 2)")
    @argument("--backend", choices=BACKENDS, default=None, help="process group backend")
    @argument("--timeout", type=float, default=None, help="torch.distributed timeout in seconds")
    @argument(
        "--hosts",
        default=None,
        help="ranks per host, in rank order: nodeA:2,nodeB:2 ([user@]host[:ranks]; implies --engines ssh)",
    )
    @argument("--engines", choices=LAUNCHERS, default=None, help="ipyparallel engine launcher")
    @argument("--ip", default=None, help="address the controller listens on (see controller_ip)")
    @line_magic
    def dist_start(self, line: str) -> None:
        """Start a cluster whose engines are the ranks of one process group."""
        args = parse_argstring(self.dist_start, line)
        if self.cluster is not None:
            print(
                f"A cluster of {self.cluster.n} ranks ({self.cluster.backend}) is already "
                "running; use %dist_restart for new engines or %dist_stop first."
            )
            return
        backend = args.backend or self.backend
        hosts = parse_hosts(args.hosts) if args.hosts is not None else []
        engines = args.engines or ("ssh" if hosts and self.engines == "local" else self.engines)
        if hosts and engines not in ("ssh", "mpi"):
            raise usage_error(f"--hosts goes with --engines ssh or mpi, not {engines}")
        if engines == "ssh" and not hosts:
            raise usage_error("--engines ssh needs --hosts, e.g. --hosts nodeA:2,nodeB:2")
        controller_ip = args.ip if args.ip is not None else self.controller_ip
        if controller_ip is not None:
            option = "--ip" if args.ip is not None else "DistributedMagics.controller_ip ="
            try:
                ipaddress.IPv4Address(controller_ip)
            except ValueError:
                raise usage_error(
                    f"{option} {controller_ip!r}: expected an IPv4 address of this host"
                ) from None
            addresses = local_addresses()
            if controller_ip != "0.0.0.0" and controller_ip not in addresses:
                raise usage_error(
                    f"{option} {controller_ip}: not an address of this machine "
                    f"(it has {', '.join(addresses)})"
                )
        elif engines == "slurm":
            raise usage_error("--engines slurm needs --ip: an address of this host that the nodes reach")
        gpus = cluster_module.visible_gpu_count() if engines == "local" else None
        world_size, asked = args.n, f"-n {args.n}"
        if hosts:
            listed = sum(host.ranks for host in hosts)
            if args.n is not None and args.n != listed:
                raise usage_error(f"-n {args.n}, but --hosts {args.hosts} gives {listed} ranks: leave -n out")
            world_size, asked = listed, f"--hosts {args.hosts} ({listed} ranks)"
        elif world_size is None and self.default_world_size is not None:
            world_size = self.default_world_size
            asked = f"DistributedMagics.default_world_size = {world_size}"
        elif world_size is None:
            world_size = gpus or 2
            asked = f"-n {world_size} (the default)"
        if world_size < 1:
            raise usage_error(f"{asked}: a cluster needs at least 1 rank")
        if engines == "local" or (engines == "mpi" and not hosts):
            self._check_local_ranks(asked, world_size)
        if world_size > MAX_WORLD_SIZE:
            raise usage_error(f"{asked}: at most {MAX_WORLD_SIZE} ranks")
        if backend == "nccl" and gpus is not None and gpus < world_size:
            raise usage_error(
                f"--backend nccl needs one GPU per rank: {world_size} ranks, {gpus} GPUs visible"
            )
        timeout = (
            checked_timeout("--timeout", args.timeout)
            if args.timeout is not None
            else self.process_group_timeout
        )
        if hosts:
            addresses = host_addresses(hosts)
            here = [host for host, address in zip(hosts, addresses) if is_local_address(address)]
            if here:
                self._check_local_ranks(
                    "--hosts " + ",".join(f"{host.location}:{host.ranks}" for host in here),
                    sum(host.ranks for host in here),
                )
        self.report_strays()
        self._last_config = dict(
            n=world_size,
            backend=backend,
            pg_timeout=timeout,
            engine_launcher=engines,
            hosts=hosts,
            controller_ip=controller_ip,
        )
        self._start(self._new_cluster())

    def _check_local_ranks(self, asked: str, ranks: int) -> None:
        if ranks > self.max_local_ranks:
            raise usage_error(
                f"{asked}: more ranks than this machine runs at once (at most {self.max_local_ranks}; "
                "%config DistributedMagics.max_local_ranks = N to allow more)"
            )

    def _new_cluster(self) -> RankCluster:
        """A cluster as the last %dist_start asked for."""
        return RankCluster(
            heartbeat_ms=self.heartbeat_ms,
            link_loss_seconds=self.link_loss_tolerance,
            ssh_command=self.ssh_command,
            remote_python=self.remote_python,
            mpi_command=self.mpi_command,
            launcher_settings=self.launcher_settings,
            **self._last_config,
        )

    def _start(self, cluster: RankCluster) -> None:
        self._with_progress("%dist_start", cluster.start)
        self.cluster = cluster
        self._restart_failed = False
        self._unfinished = None
        atexit.register(cluster.stop)
        print(self._summary())

    def _with_progress(self, magic: str, action: Callable[[Progress], None]) -> None:
        """Run ``action(progress)``, showing each step it reports while it runs; a ClusterError
        becomes a one-line error."""
        live = LiveView(self._in_kernel())
        steps: list[str] = []

        def progress(message: str) -> None:
            steps.append(message)
            live.update("<br>".join(html.escape(step) for step in steps) + " …")

        try:
            action(progress)
        except ClusterError as error:
            raise usage_error(f"{magic} failed: {error}") from None
        finally:
            live.close()

    def _summary(self) -> str:
        devices = [info.device for info in self.cluster.ranks]
        same = len(set(devices)) == 1
        device_text = f"{devices[0]} x{len(devices)}" if same else ", ".join(devices)
        return (
            f"{self.cluster.n} ranks ready: backend {self.cluster.backend}, "
            f"world size {self.cluster.n}, devices {device_text}"
        )

    @line_magic
    def dist_stop(self, line: str) -> None:
        """Stop the cluster: controller, engines and their files."""
        if line.strip():
            raise usage_error(f"%dist_stop takes no arguments, got {line.strip()!r}")
        if self.cluster is None:
            print("No cluster is running.")
            return
        world_size = self.cluster.n
        self._stop_cluster()
        self._restart_failed = False
        print(f"Stopped {world_size} ranks.")

    def _stop_cluster(self) -> None:
        cluster, self.cluster = self.cluster, None
        self._unfinished = None
        self._stale, self._cut_peers = {}, frozenset()
        if cluster is not None:
            cluster.stop()
            atexit.unregister(cluster.stop)

    @line_magic
    def dist_restart(self, line: str) -> None:
        """New engines with the same world size, backend and rank -> device mapping."""
        if line.strip():
            raise usage_error(f"%dist_restart takes no arguments, got {line.strip()!r}")
        if self.cluster is None and self._last_config is None:
            raise usage_error("No cluster to restart: start one with %dist_start")
        if self.cluster is not None and self.cluster.restartable_in_place:
            # The controller and the zygote stay: only the engines are new.
            self._unfinished = None
            self._stale, self._cut_peers = {}, frozenset()
            try:
                self._with_progress("%dist_restart", self.cluster.restart)
            finally:
                if not self.cluster.running:  # the restart failed and stopped the cluster
                    self._stop_cluster()
                    self._restart_failed = True
            print(self._summary())
            return
        if self.cluster is not None:
            self._last_config["backend"] = self.cluster.backend
            self._stop_cluster()
        self._start(self._new_cluster())

    @magic_arguments()
    @argument(
        "--shrink",
        action="store_true",
        help="go on without dead ranks (the others renumbered) instead of replacing them",
    )
    @line_magic
    def dist_recover(self, line: str) -> None:
        """Get every rank back after a hang or a dead rank, keeping each living rank's state: the
        old process groups are cut (ending blocked collectives), ranks still running are
        interrupted, dead ranks are replaced (or left out with --shrink), and a new default
        process group forms."""
        args = parse_argstring(self.dist_recover, line)
        if self.cluster is None:
            raise self._no_cluster()
        recovery: list[Recovery] = []
        try:
            self._with_progress(
                "%dist_recover",
                lambda progress: recovery.append(
                    self.cluster.recover(self._unfinished, args.shrink, self.interrupt_grace, progress)
                ),
            )
        finally:
            if recovery:
                self._unfinished = None
        [done] = recovery
        if done.dropped:
            self._last_config["n"] = done.world_size
        self._stale, self._cut_peers = done.stale, frozenset().union(*done.cut_peers.values())
        print(recovery_report(done, self.cluster.backend))

    # ------------------------------------------------------------------ debugging
    @magic_arguments()
    @argument("--rank", type=int, default=None, help="the rank to debug (default: the lowest that raised)")
    @argument("-c", dest="commands", default=None, help="pdb commands separated by ';', run without a prompt")
    @line_magic
    def dist_debug(self, line: str) -> None:
        """pdb post-mortem on a rank where the last failed cell raised, like IPython's %debug:
        at a prompt answered in the notebook, or running ``-c`` commands."""
        args = parse_argstring(self.dist_debug, line)
        cluster = self._ready_cluster()
        if args.rank is None:
            if not self._last_raised:
                raise usage_error("%dist_debug: no rank raised in the last failed cell; name one with --rank")
            rank = self._last_raised[0]
        else:
            rank = parse_rank_spec(str(args.rank), cluster.n)[0]
        try:
            shown = cluster.start_post_mortem(rank)
        except ClusterError as error:
            raise usage_error(f"%dist_debug: {error}") from None
        print(f"[rank {rank}]")
        print(shown, end="")
        commands = args.commands
        if commands and len(commands) > 1 and commands[0] == commands[-1] and commands[0] in "'\"":
            commands = commands[1:-1]  # IPython's argument splitting keeps the quotes
        try:
            self._post_mortem(cluster, rank, commands)
        except ClusterError as error:
            raise usage_error(f"%dist_debug: {error}") from None

    def _post_mortem(self, cluster: RankCluster, rank: int, commands_line: str | None) -> None:
        """Feed pdb on ``rank`` the ``-c`` commands, or what is typed at the prompt until pdb ends."""
        still_open = True
        try:
            if commands_line is not None:
                commands = [command.strip() for command in commands_line.split(";") if command.strip()]
                shown, still_open = cluster.post_mortem_commands(rank, commands)
                print(shown, end="")
                return
            while still_open:
                try:
                    command = input(f"(Pdb rank {rank}) ")
                except (StdinNotImplementedError, OSError):  # no stdin (nbval, nbclient; pytest's OSError)
                    print('%dist_debug: no input can be read here; give pdb commands with -c "p x; w"')
                    return
                except (EOFError, KeyboardInterrupt):
                    return
                shown, still_open = cluster.post_mortem_commands(rank, [command])
                print(shown, end="")
        finally:
            if still_open:
                cluster.end_post_mortem(rank)

    @line_magic
    def dist_diff(self, line: str) -> None:
        """``%dist_diff EXPR [--ranks SPEC]``: evaluate EXPR on every rank and show where the ranks
        agree and where they differ (tensors, numbers, containers, a module's parameters and
        buffers, an optimizer's state), each rank against the lowest."""
        match = re.fullmatch(r"\s*(.*?)(?:\s+--ranks\s+(\S+))?\s*", line, re.DOTALL)
        expression, spec = match[1], match[2]
        if not expression:
            raise usage_error("%dist_diff needs an expression, e.g. %dist_diff model")
        cluster = self._ready_cluster()
        ranks = parse_rank_spec(spec, cluster.n) if spec else list(range(cluster.n))
        try:
            snapshots = cluster.snapshots(ranks, expression)
        except ClusterError as error:
            raise usage_error(f"%dist_diff {expression}: {error}") from None
        print("\n".join(describe_differences(expression, snapshots)))

    def _no_cluster(self) -> Exception:
        if self._restart_failed:
            return usage_error(
                "No cluster is running: the last %dist_restart failed and stopped it (nothing of it is "
                "left); %dist_restart starts it again as it was"
            )
        return usage_error("No cluster is running: start one with %dist_start")

    def report_strays(self) -> None:
        for report in cluster_module.stop_stray_clusters():
            print(f"ddp_magics: {report}.")

    # -------------------------------------------------------------------- running
    @magic_arguments()
    @argument("--ranks", default=None, help="ranks to run on, e.g. 0 or 0,2 or 1-3 (default: all)")
    @argument("--timeout", type=float, default=None, help="seconds before a hang is reported")
    @argument("--diagram", action="store_true", help="draw the torch.distributed calls the cell made")
    @argument("--trace", metavar="NAME", default=None, help="keep the cell's trace in variable NAME")
    @cell_magic
    def distributed(self, line: str, cell: str) -> None:
        """Run the cell on every rank (or --ranks) and show the output in rank order."""
        args = parse_argstring(self.distributed, line)
        if args.trace is not None and not is_variable_name(args.trace):
            raise usage_error(f"--trace {args.trace!r}: expected a variable name")
        timeout = (
            checked_timeout("--timeout", args.timeout) if args.timeout is not None else self.cell_timeout
        )
        cluster = self._ready_cluster()
        ranks = parse_rank_spec(args.ranks, cluster.n) if args.ranks is not None else list(range(cluster.n))
        traced = args.diagram or args.trace is not None
        if traced:
            try:
                cluster.start_trace(ranks, self.trace_values_limit)
            except ClusterError as error:
                raise usage_error(f"--trace/--diagram: {error}") from None
        run = cluster.execute(cell, ranks, self._cell_number())
        ended = self._wait(run, timeout, cell)
        self._finish(
            run,
            cell,
            traced,
            timeout if ended == ENDED_TIMEOUT else None,
            ended == ENDED_INTERRUPT,
            diagram=args.diagram,
            trace_name=args.trace,
        )

    def _ready_cluster(self) -> RankCluster:
        """The running cluster, if every rank can take a new cell."""
        if self.cluster is None:
            raise self._no_cluster()
        dead = self.cluster.dead_ranks()
        if dead:
            raise usage_error(f"{rank_label(dead)} died (engine process gone). {RESTART_ADVICE}")
        if self._unfinished is not None:
            busy = self._unfinished.pending_ranks()
            if busy:
                raise usage_error(f"{rank_label(busy)} still running an earlier cell. {RESTART_ADVICE}")
            self._unfinished = None
        return self.cluster

    def _wait(self, run: CellRun, timeout: float, cell: str = "") -> str:
        """Wait for the ranks; returns why the wait ended (one of the ``ENDED_*``). Time spent at
        a rank's debugger prompt does not count towards the timeout or the error grace."""
        live = LiveView(self._in_kernel())
        started = time.monotonic()
        failed_since = None
        last_refresh = 0.0
        no_input = False  # the front end gave no input once: later breakpoints are skipped
        try:
            while not run.wait(POLL_SECONDS):
                prompts = run.new_debugger_prompts()
                if prompts:
                    paused = time.monotonic()
                    no_input = self._answer_breakpoint(run, prompts, no_input, cell)
                    paused = time.monotonic() - paused
                    started += paused
                    failed_since = None if failed_since is None else failed_since + paused
                    continue
                now = time.monotonic()
                if failed_since is None and run.errors():
                    failed_since = now
                if failed_since is not None and now - failed_since > self.error_grace:
                    return ENDED_AFTER_ERROR
                if now - started > timeout:
                    return ENDED_TIMEOUT
                if now - started > self.live_view_after and now - last_refresh > LIVE_REFRESH_SECONDS:
                    live.update(self._live_html(run, now - started))
                    last_refresh = now
            return ENDED_DONE
        except KeyboardInterrupt:
            # A rank whose pdb was just quit ends by itself: an interrupt would cut its error short.
            pending = [rank for rank in run.pending_ranks() if rank not in run.quitting_debugger]
            if pending:
                self.cluster.interrupt(pending)
            run.wait(self.interrupt_grace)
            return ENDED_INTERRUPT
        finally:
            live.close()

    def _skip_breakpoints(self, rank: int) -> bool:
        """No input can be read here: ``rank`` skips this cell's breakpoints, said in one line."""
        self.cluster.debugger_input(rank, SKIP_BREAKPOINTS)
        print(f"[rank {rank}] breakpoint() skipped: no input can be read here")
        return True

    def _show_where_the_others_are(self, run: CellRun, stopped: int, cell: str) -> None:
        """As a rank first stops in pdb: where the ranks still running are (one line per place)."""
        others = [rank for rank in run.pending_ranks() if rank != stopped]
        if not others:
            return
        dumps = self.cluster.inspect(run, others, wait=1.0)
        places: dict[str, list[int]] = {}
        for rank in others:
            blocked = BlockedRank.from_dump(rank, dumps[rank].stack if rank in dumps else None, cell)
            places.setdefault(blocked.where(), []).append(rank)
        for where, ranks in places.items():
            print(f"[{rank_label(ranks)}] meanwhile {where}")

    def _answer_breakpoint(self, run: CellRun, prompts: dict, no_input: bool, cell: str) -> bool:
        """Show the lowest stopped rank's pdb output and hand it the line typed at the notebook's
        prompt; ranks stopped together are served in rank order. Without input (nbval, nbclient)
        the cell's breakpoints are skipped, said once per rank. Returns whether input is missing."""
        rank = min(prompts)
        prompt = prompts[rank]
        run.answer_prompt(rank, prompt)
        if no_input or not self._input_allowed():
            return self._skip_breakpoints(rank)
        if prompt.output:
            print(f"[rank {rank}]\n{prompt.output}", end="" if prompt.output.endswith("\n") else "\n")
        if prompt.number == 1:
            self._show_where_the_others_are(run, rank, cell)
        try:
            line = input(f">>> (rank {rank}) " if prompt.console else f"(Pdb rank {rank}) ")
        except (StdinNotImplementedError, OSError, EOFError):
            return self._skip_breakpoints(rank)
        except KeyboardInterrupt:  # the stop button at the prompt: end debugging and the cell
            self.cluster.debugger_input(rank, "q")
            run.quit_debugging(rank)
            raise
        self.cluster.debugger_input(rank, line)
        return False

    def _finish(
        self,
        run: CellRun,
        cell: str,
        traced: bool,
        timed_out_after: float | None,
        interrupted: bool,
        diagram: bool = False,
        trace_name: str | None = None,
    ) -> None:
        pending = run.pending_ranks()
        if not pending:
            run.wait_for_output(timeout=5)
        for item in render(run.outputs(), self.collapse_identical, self.max_output_lines):
            if isinstance(item, dict):
                display(item["data"], metadata=item["metadata"], raw=True)
            else:
                display(item)
        errors = run.errors()
        clean = not (pending or errors)
        # A rank that died mid-cell answers with an EngineError; report it as dead, not as raising.
        dead = [] if clean else [rank for rank in self.cluster.dead_ranks() if rank in run.ranks]
        alive_pending = [rank for rank in pending if rank not in dead]
        inspections = self.cluster.inspect(run, alive_pending) if alive_pending else {}
        trace = self._trace(run, pending, dead, inspections) if traced else None
        if trace_name is not None:
            self.shell.user_ns[trace_name] = trace
        if diagram:
            self._show_diagram(trace)
        if clean:
            return
        failures = [
            stale_group_failure(
                failure_from_remote_error(rank, error),
                self._stale.get(rank, ()),
                self._cut_peers,
            )
            for rank, error in errors.items()
            if rank not in dead
        ]
        blocked = [
            BlockedRank.from_dump(
                rank,
                inspections[rank].stack if rank in inspections else None,
                cell,
                traced_call=_traced_call(trace, rank),
            )
            for rank in alive_pending
        ]
        if alive_pending:
            self._unfinished = run
        self._last_raised = sorted(failure.rank for failure in failures)
        failed_or_dead = {failure.rank for failure in failures} | set(dead)
        raise DistributedCellError(
            failures=failures,
            blocked=blocked,
            finished=[r for r in run.ranks if r not in pending and r not in failed_or_dead],
            dead=dead,
            deaths=[self._death(rank, cell) for rank in dead],
            timeout=timed_out_after,
            interrupted=interrupted,
            usable=not (alive_pending or dead),
            mismatches=[mismatch.message for mismatch in trace.mismatches] if trace else [],
        )

    def _death(self, rank: int, cell: str) -> DeadRank:
        how, crash_dump = self.cluster.death_record(rank)
        crashed_at = BlockedRank.from_dump(rank, crash_dump, cell) if crash_dump else None
        return DeadRank(rank, how, crashed_at)

    def _trace(self, run: CellRun, pending: list[int], dead: list[int], inspections: dict) -> Trace:
        """The cell's trace: what finished ranks published as the cell ended, and what ranks
        still running had recorded when inspected."""
        events = {}
        for rank in run.ranks:
            if rank in inspections:
                events[rank] = inspections[rank].events or []
            elif rank in pending or rank in dead:
                events[rank] = []
            else:
                events[rank] = run.published(rank, TRACE_KEY, wait=TRACE_ARRIVAL_SECONDS) or []
        return Trace(events, complete=not (pending or dead), lost=frozenset(dead))

    def _show_diagram(self, trace: Trace) -> None:
        if not trace.steps:
            print(
                "--diagram: the cell made no torch.distributed calls (calls through names imported "
                "before the cell, like `from torch.distributed import send`, are not traced)"
            )
            return
        display(trace.draw())

    def _live_html(self, run: CellRun, elapsed: float) -> str:
        return live_html(run.outputs(), set(run.pending_ranks()), elapsed, LIVE_TAIL_LINES)

    # ----------------------------------------------------------------- inspecting
    @line_magic
    def dist_status(self, line: str) -> StatusTable:
        """Ranks, hosts, PIDs, devices, backend and whether each rank is alive."""
        if line.strip():
            raise usage_error(f"%dist_status takes no arguments, got {line.strip()!r}")
        if self.cluster is None:
            raise self._no_cluster()
        busy = self._unfinished.pending_ranks() if self._unfinished else []
        return StatusTable(self.cluster.backend, self.cluster.status(), busy)

    @line_magic
    def dist_push(self, line: str) -> None:
        """Copy notebook variables to every rank: %dist_push NAME [NAME ...]."""
        names = line.split()
        if not names:
            raise usage_error("%dist_push needs at least one variable name")
        missing = [name for name in names if name not in self.shell.user_ns]
        if missing:
            raise usage_error(f"%dist_push: not defined in the notebook: {', '.join(missing)}")
        cluster = self._ready_cluster()
        cluster.push({name: self.shell.user_ns[name] for name in names})

    @line_magic
    def dist_pull(self, line: str) -> dict:
        """``x = %dist_pull NAME`` returns ``{rank: value}``."""
        names = line.split()
        if len(names) != 1:
            raise usage_error("%dist_pull takes exactly one variable name")
        if not is_variable_name(names[0]):
            raise usage_error(f"%dist_pull {names[0]!r}: expected a variable name")
        cluster = self._ready_cluster()
        try:
            return cluster.pull(names[0])
        except ClusterError as error:
            raise usage_error(f"%dist_pull: {error}") from None

    # --------------------------------------------------------------------- helpers
    def _cell_number(self) -> int:
        """The number the notebook shows for the cell running now (``In[N]``)."""
        running = self.shell.displayhook.exec_result  # set by IPython for the length of a cell
        if running is not None and running.execution_count is not None:
            return running.execution_count
        return self.shell.execution_count

    def _input_allowed(self) -> bool:
        """Whether the front end that sent the running cell takes input (nbval and nbclient do
        not); True outside a kernel, where input() reads the terminal."""
        kernel = getattr(self.shell, "kernel", None)
        if kernel is None:
            return True
        return bool(kernel.get_parent("shell").get("content", {}).get("allow_stdin", False))

    def _in_kernel(self) -> bool:
        return getattr(self.shell, "kernel", None) is not None

    def shutdown(self) -> None:
        """Stop the cluster (used by %unload_ext)."""
        self._stop_cluster()
