"""Making engines the ranks of one process group: probing them, numbering them host by host,
choosing the backend, and the rendezvous every rank joins (at start, and again at recovery)."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path

from ddp_magics import protocol
from ddp_magics.addresses import address_towards
from ddp_magics.cluster.engines import Engines
from ddp_magics.cluster.records import (
    RECOVER_AGAIN,
    RESTART,
    ClusterError,
    HostSpec,
    Progress,
    RankInfo,
    nccl_shortfall,
)
from ddp_magics.engine import rank as rank_code


def nvidia_driver_here() -> bool:
    """Whether this machine has NVIDIA's driver (so a process here may use CUDA), without torch."""
    return Path("/dev/nvidiactl").exists()


def visible_gpu_count() -> int:
    """GPUs this process can see, without importing torch when there can be none."""
    if "torch" not in sys.modules and not nvidia_driver_here():
        return 0
    import torch

    return torch.cuda.device_count()


def resolve_backend(requested: str, gpus_per_rank: list[int]) -> str:
    """auto means nccl when every rank has a GPU of its own, else gloo."""
    if requested != "auto":
        return requested
    return "nccl" if gpus_per_rank and all(gpus_per_rank) else "gloo"


def probe(engines: Engines, engine_ids: list[int], controller_address: str) -> list[protocol.EngineProbe]:
    """Each engine's host, PID and GPUs (its import of torch done)."""
    return engines.apply(engine_ids, rank_code.probe_engine, controller_address, doing="importing torch")


def form(
    engines: Engines,
    n: int,
    hosts: tuple[HostSpec, ...],
    requested_backend: str,
    process_group_timeout: float,
    controller_address: str,
    progress: Progress,
    one_host: bool = False,
) -> str:
    """Number ``n`` connected engines host by host, make them the ranks of a new default process
    group, and return its backend. With every engine on this host (``one_host``), rank 0 is the
    first engine, and its store opens as it is probed: one round trip less."""
    engine_ids = sorted(engines.ids)[:n]
    progress("importing torch on the engines")
    port = None
    if one_host:
        opening = (address_towards(controller_address), n, process_group_timeout)  # its probe's address
        calls = [(engine_ids[0], rank_code.probe_and_open_rendezvous, (controller_address, *opening))]
        calls += [(engine_id, rank_code.probe_engine, (controller_address,)) for engine_id in engine_ids[1:]]
        (first, port), *others = engines.apply_each(calls, lambda index: "importing torch")
        probes = [first, *others]
    else:
        engine_ids, probes = _host_by_host(hosts, engine_ids, probe(engines, engine_ids, controller_address))
    addresses = [found.address for found in probes]
    host_order = list(dict.fromkeys(addresses))
    local_ranks = [addresses[:index].count(address) for index, address in enumerate(addresses)]
    gpus = [int(found.gpu_count > local) for found, local in zip(probes, local_ranks)]
    backend = resolve_backend(requested_backend, gpus)
    if backend == "nccl":
        for address in host_order:
            on_host = [found for found in probes if found.address == address]
            problem = nccl_shortfall(on_host[0].host, len(on_host), on_host[0].gpu_count)
            if problem:
                raise ClusterError(problem)
    engines.set_ranks(
        [
            RankInfo(
                rank=rank,
                engine_id=engine_id,
                host=found.host,
                pid=found.pid,
                local_rank=local_rank,
                device=f"cuda:{local_rank}" if backend == "nccl" else "cpu",
                address=found.address,
                group_rank=host_order.index(found.address),
            )
            for rank, (engine_id, found, local_rank) in enumerate(zip(engine_ids, probes, local_ranks))
        ]
    )
    progress(f"forming the {backend} process group")
    join(engines, backend, process_group_timeout, lambda info: rank_code.setup_rank, port)
    return backend


def _host_by_host(hosts: tuple[HostSpec, ...], engine_ids: list[int], probes: list) -> tuple[list[int], list]:
    """Engines ordered host by host (in the order of the host list), by engine id within a host."""
    listed = [host.address for host in hosts]
    addresses = [found.address for found in probes]
    first_seen = list(dict.fromkeys(addresses))

    def host_place(address: str) -> tuple[int, int]:
        if address in listed:
            return (listed.index(address), 0)
        return (len(listed), first_seen.index(address))

    order = sorted(range(len(probes)), key=lambda i: (host_place(addresses[i]), engine_ids[i]))
    return [engine_ids[i] for i in order], [probes[i] for i in order]


def setups(ranks: list[RankInfo], backend: str, process_group_timeout: float) -> list[protocol.RankSetup]:
    """What makes each engine of ``ranks`` its rank (before rank 0's store listens)."""
    addresses = [info.address for info in ranks]
    host_order = list(dict.fromkeys(addresses))
    return [
        protocol.RankSetup(
            rank=info.rank,
            local_rank=info.local_rank,
            world_size=len(ranks),
            master_addr=addresses[0],  # 127.0.0.1 on one host; else rank 0's host's address
            master_port=0,
            backend=backend,
            device=info.device,
            timeout_s=process_group_timeout,
            group_rank=host_order.index(info.address),
            group_world_size=len(host_order),
            local_world_size=addresses.count(info.address),
            address=info.address if len(host_order) > 1 else None,
        )
        for info in ranks
    ]


def join(
    engines: Engines,
    backend: str,
    process_group_timeout: float,
    joiner: Callable[[RankInfo], Callable],
    port: int | None = None,
) -> dict[int, object]:
    """Rank 0 opens a new rendezvous (unless its store listens on ``port`` already), then every
    rank runs ``joiner(info)(its setup)``; each rank's answer."""
    ranks = engines.ranks
    gone = [info.rank for info in ranks if info.engine_id not in engines.ids]
    if gone:
        raise ClusterError(
            f"{protocol.rank_label(gone)} died (or lost its link to this machine) just now",
            RECOVER_AGAIN,
            RESTART,
        )
    planned = setups(ranks, backend, process_group_timeout)
    if port is None:
        opening = (planned[0].master_addr, len(ranks), process_group_timeout)
        [port] = engines.apply_each(
            [(ranks[0].engine_id, rank_code.open_rendezvous, opening)], lambda _: "opening rank 0's store"
        )
    planned = [dataclasses.replace(setup, master_port=port) for setup in planned]
    answers = engines.apply_each(
        [(info.engine_id, joiner(info), (setup,)) for info, setup in zip(ranks, planned)],
        lambda index: f"rank {ranks[index].rank} joining the process group",
    )
    return dict(zip([info.rank for info in ranks], answers))
