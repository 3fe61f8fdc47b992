"""What the user typed, checked once: rank specs, timeouts, variable names, host lists, and the
start request (``%dist_start``'s options with the magics' settings) made a
:class:`~ddp_magics.cluster.records.ClusterConfig`. Every mistake is a one-line UsageError."""

from __future__ import annotations

import argparse
import ipaddress
import keyword
import math
import re
import socket
from typing import Any

from IPython.core.magic_arguments import argument

from ddp_magics.addresses import is_loopback
from ddp_magics.cluster.process_group import visible_gpu_count
from ddp_magics.cluster.records import HEARTBEAT_SILENCE_MS, ClusterConfig, HostSpec, nccl_shortfall
from ddp_magics.errors import usage_error
from ddp_magics.protocol import format_ranks

# torch keeps timeouts in milliseconds; nobody waits a month for a collective or a cell.
MAX_TIMEOUT_SECONDS = 30 * 24 * 3600
MAX_WORLD_SIZE = 65536
MAX_RANKS_PER_HOST = 1024
# Each count setting's range (low, high or None); the magics' traits are validated against it.
COUNT_LIMITS = {
    "default_world_size": (1, MAX_WORLD_SIZE),
    "max_local_ranks": (1, MAX_WORLD_SIZE),
    "heartbeat_ms": (10, HEARTBEAT_SILENCE_MS),
    "max_output_lines": (0, None),
    "trace_values_limit": (0, None),
}


def ranks_option(help_text: str):
    """``--ranks SPEC``, as every magic that takes ranks spells it (a ``magic_arguments`` decorator)."""
    return argument("--ranks", metavar="SPEC", default=None, help=help_text)


# ``--timeout SECONDS`` of a cell: how long before its ranks are reported.
cell_timeout_option = argument(
    "--timeout", type=float, default=None, help="seconds before a hang is reported (default: cell_timeout)"
)
_RANKS_OPTION = re.compile(r"(?:^|\s)--ranks(?:\s+|=)\S+(?=\s|$)")


def without_ranks_option(line: str) -> str:
    """The code of a line whose ``--ranks SPEC`` (before or after the code) was parsed apart."""
    return _RANKS_OPTION.sub(" ", line).strip()


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


def chosen_ranks(spec: str | None, world_size: int) -> list[int]:
    """The ranks ``--ranks spec`` names; every rank without it."""
    return parse_rank_spec(spec, world_size) if spec is not None else list(range(world_size))


def timeout_problem(seconds: float) -> str | None:
    """Why ``seconds`` is not a usable timeout, or None."""
    if math.isfinite(seconds) and 0 < seconds <= MAX_TIMEOUT_SECONDS:
        return None
    return f"must be more than 0 seconds and at most {MAX_TIMEOUT_SECONDS} (30 days)"


def wait_problem(seconds: float) -> str | None:
    """Why ``seconds`` is not a usable wait (0 allowed), or None."""
    if math.isfinite(seconds) and 0 <= seconds <= MAX_TIMEOUT_SECONDS:
        return None
    return f"must be from 0 seconds to {MAX_TIMEOUT_SECONDS} (30 days)"


def count_problem(name: str, value: int | None) -> str | None:
    """Why ``value`` is outside the range of the count setting ``name``, or None."""
    low, high = COUNT_LIMITS[name]
    if value is None or (low <= value and (high is None or value <= high)):
        return None
    return f"must be from {low} to {high}" if high is not None else f"must be at least {low}"


def timeout_or(option: str, seconds: float | None, default: float) -> float:
    """``seconds`` if given and usable, ``default`` if not given; UsageError naming ``option``."""
    if seconds is None:
        return default
    problem = timeout_problem(seconds)
    if problem:
        raise usage_error(f"{option} {seconds:g}: {problem}")
    return seconds


def is_variable_name(name: str) -> bool:
    return name.isidentifier() and not keyword.iskeyword(name)


def variable_name(magic: str, name: str) -> str:
    """``name`` if it can name a variable; UsageError otherwise."""
    if not is_variable_name(name):
        raise usage_error(f"{magic} {name!r}: expected a variable name")
    return name


def local_addresses() -> list[str]:
    """This machine's IPv4 addresses (in the kernel's network namespace)."""
    import psutil

    entries = [entry for interface in psutil.net_if_addrs().values() for entry in interface]
    return sorted({entry.address for entry in entries if entry.family == socket.AF_INET})


def is_local_address(address: str) -> bool:
    return is_loopback(address) or address in local_addresses()


# ``[user@]host[:port]``: names of letters, digits, ``.``, ``_`` and ``-``, none starting with
# ``-`` (ssh would read it as an option); nothing a shell would interpret.
_NAME = r"[A-Za-z0-9_.][A-Za-z0-9_.-]*"
SSH_LOCATION = re.compile(rf"(?:{_NAME}@)?{_NAME}(?::[0-9]{{1,5}})?")


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


def with_addresses(hosts: list[HostSpec]) -> list[HostSpec]:
    """The hosts with their IPv4 addresses, resolved here once; UsageError for an unknown host
    or for two hosts that are one (``localhost`` and ``127.0.0.1``): ranks are placed by address."""
    addresses = [_ipv4_address(host.name) for host in hosts]
    for i, address in enumerate(addresses):
        if address in addresses[:i]:
            first = hosts[addresses.index(address)].name
            raise usage_error(
                f"--hosts: {first} and {hosts[i].name} are the same host ({address}); list each host once"
            )
    return [HostSpec(host.location, host.ranks, address) for host, address in zip(hosts, addresses)]


def _ipv4_address(host: str) -> str:
    """``host``'s IPv4 address (the name resolved here); UsageError if it has none."""
    try:
        return socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except socket.gaierror as error:
        raise usage_error(f"--hosts: unknown host {host!r}: {error.strerror}") from None
    except UnicodeError:  # a label longer than DNS allows
        raise usage_error(f"--hosts: unknown host {host!r}: not a valid host name") from None


def _controller_ip(args: argparse.Namespace, settings: Any, engines: str) -> str | None:
    controller_ip = args.ip if args.ip is not None else settings.controller_ip
    if controller_ip is None:
        if engines == "slurm":
            raise usage_error("--engines slurm needs --ip: an address of this host that the nodes reach")
        return None
    option = "--ip" if args.ip is not None else "DistributedMagics.controller_ip ="
    try:
        ipaddress.IPv4Address(controller_ip)
    except ValueError:
        raise usage_error(f"{option} {controller_ip!r}: expected an IPv4 address of this host") from None
    addresses = local_addresses()
    if controller_ip != "0.0.0.0" and controller_ip not in addresses:
        raise usage_error(
            f"{option} {controller_ip}: not an address of this machine (it has {', '.join(addresses)})"
        )
    return controller_ip


def _check_local_ranks(asked: str, ranks: int, settings: Any) -> None:
    if ranks > settings.max_local_ranks:
        raise usage_error(
            f"{asked}: more ranks than this machine runs at once (at most {settings.max_local_ranks}; "
            "%config DistributedMagics.max_local_ranks = N to allow more)"
        )


def start_config(args: argparse.Namespace, settings: Any) -> ClusterConfig:
    """``%dist_start``'s options (``args``) over the magics' settings (``settings``: the
    DistributedMagics traits, which hold every default), checked: the cluster to start."""
    backend = args.backend or settings.backend
    hosts = parse_hosts(args.hosts) if args.hosts is not None else []
    engines = args.engines or ("ssh" if hosts and settings.engines == "local" else settings.engines)
    if hosts and engines not in ("ssh", "mpi"):
        raise usage_error(f"--hosts goes with --engines ssh or mpi, not {engines}")
    if engines == "ssh" and not hosts:
        raise usage_error("--engines ssh needs --hosts, e.g. --hosts nodeA:2,nodeB:2")
    controller_ip = _controller_ip(args, settings, engines)
    gpus = visible_gpu_count() if engines == "local" else None
    world_size, asked = args.n, f"-n {args.n}"
    if hosts:
        listed = sum(host.ranks for host in hosts)
        if args.n is not None and args.n != listed:
            raise usage_error(f"-n {args.n}, but --hosts {args.hosts} gives {listed} ranks: leave -n out")
        world_size, asked = listed, f"--hosts {args.hosts} ({listed} ranks)"
    elif world_size is None and settings.default_world_size is not None:
        world_size = settings.default_world_size
        asked = f"DistributedMagics.default_world_size = {world_size}"
    elif world_size is None:
        world_size = gpus or 2
        asked = f"-n {world_size} (the default)"
    if world_size < 1:
        raise usage_error(f"{asked}: a cluster needs at least 1 rank")
    if engines == "local" or (engines == "mpi" and not hosts):
        _check_local_ranks(asked, world_size, settings)
    if world_size > MAX_WORLD_SIZE:
        raise usage_error(f"{asked}: at most {MAX_WORLD_SIZE} ranks")
    if backend == "nccl" and gpus is not None:
        problem = nccl_shortfall("this machine", world_size, gpus)
        if problem:
            raise usage_error(f"--backend nccl: {problem}")
    timeout = timeout_or("--timeout", args.timeout, settings.process_group_timeout)
    hosts = with_addresses(hosts)
    here = [host for host in hosts if is_local_address(host.address)]
    if here:
        _check_local_ranks(
            "--hosts " + ",".join(f"{host.location}:{host.ranks}" for host in here),
            sum(host.ranks for host in here),
            settings,
        )
    return ClusterConfig(
        n=world_size,
        backend=backend,
        process_group_timeout=timeout,
        engines=engines,
        hosts=tuple(hosts),
        controller_ip=controller_ip,
        heartbeat_ms=settings.heartbeat_ms,
        park_after=settings.park_idle_after,
        link_loss_tolerance=settings.link_loss_tolerance,
        ssh_command=tuple(settings.ssh_command),
        remote_python=settings.remote_python,
        mpi_command=tuple(settings.mpi_command),
        launcher_settings=dict(settings.launcher_settings),
    )
