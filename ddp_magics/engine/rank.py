"""Code that runs on an engine: probing, process-group setup and the names a cell sees.

Nothing here imports notebook-side modules; the functions are sent to engines by
reference (``ddp_magics.engine.rank.setup_rank``), so this module must import cheaply.
"""

from __future__ import annotations

import os
import socket
import threading

from ddp_magics.addresses import address_towards
from ddp_magics.engine import debugging, launched, recovery
from ddp_magics.engine.inspector import start_inspector
from ddp_magics.protocol import CELL_NUMBER_HEADER, EngineProbe, RankSetup, Rejoined

INLINE_BACKEND = "module://matplotlib_inline.backend_inline"

# Rank 0's rendezvous store between open_rendezvous() and setup_rank().
_rendezvous_server = None


def start_background_import() -> None:
    """Import torch.distributed in a thread so it overlaps engine registration.

    Run as the engine's startup command; a later ``import torch`` in the main thread
    waits for this import instead of starting a second one.
    """
    threading.Thread(target=__import__, args=("torch.distributed",), daemon=True).start()


def take_cell_number(lines: list[str]) -> list[str]:
    """IPython input transformer (run before any other): drop the header of :func:`numbered_cell`
    and number the cell as the notebook does, so tracebacks (``Cell In[9]``), ``Out[9]`` and
    ``_i9`` on a rank name the notebook's cell 9. (Engines keep no history database, which
    would refuse a number twice.)"""
    if not lines or not lines[0].startswith(CELL_NUMBER_HEADER):
        return lines
    from IPython import get_ipython

    shell = get_ipython()
    number = int(lines[0][len(CELL_NUMBER_HEADER) :].strip().rstrip("]"))
    shell.execution_count = number
    debugging.new_cell()
    return lines[1:]


def probe_engine(controller_address: str) -> EngineProbe:
    """This engine's host, GPUs and the address it reaches the controller from."""
    import torch

    return EngineProbe(
        host=socket.gethostname(),
        address=address_towards(controller_address),
        pid=os.getpid(),
        gpu_count=torch.cuda.device_count(),
    )


def interface_of(address: str) -> str | None:
    """The name of the network interface that has ``address``."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(entry.family == socket.AF_INET and entry.address == address for entry in addresses):
            return name
    return None


def probe_and_open_rendezvous(
    controller_address: str, master_addr: str, world_size: int, timeout_s: float
) -> tuple[EngineProbe, int]:
    """:func:`probe_engine` and :func:`open_rendezvous` in one call, on the engine that will be
    rank 0 when every engine is on one host (the ranks then follow the engines' order)."""
    return probe_engine(controller_address), open_rendezvous(master_addr, world_size, timeout_s)


def open_rendezvous(master_addr: str, world_size: int, timeout_s: float) -> int:
    """On rank 0, before any rank joins: start the store the ranks meet at, listening on
    MASTER_ADDR only (127.0.0.1 on one host), on a port the system picks; returns the port.

    The store listens on a socket bound here and handed to it (``master_listen_fd``), so the
    port is never free between being picked and being listened on (nobody can take it), and
    TCPStore does not listen on every interface as it does when given a port to bind itself.
    Ranks that connect before it listens back off for about half a second; started first, it
    listens when they come. It is the store ``env://`` would make (``multi_tenant``, so a later
    ``env://`` group on this port in this process shares it), and only the process group keeps
    it once formed: destroying the group frees the port, as with ``env://``.
    """
    global _rendezvous_server
    from datetime import timedelta

    import torch.distributed as dist

    recovery.begin_forming()  # the store's connections belong to the new era
    listener = socket.create_server((master_addr, 0), backlog=max(world_size, 128))
    port = listener.getsockname()[1]
    _rendezvous_server = dist.TCPStore(
        master_addr,
        port,
        world_size,
        is_master=True,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
        multi_tenant=True,
        master_listen_fd=listener.detach(),  # the store closes it
    )
    return port


def _rendezvous_store(setup: RankSetup, timeout):
    global _rendezvous_server
    import torch.distributed as dist

    if setup.rank == 0:
        store, _rendezvous_server = _rendezvous_server, None
        return store
    return dist.TCPStore(
        setup.master_addr, setup.master_port, setup.world_size, is_master=False, timeout=timeout
    )


def setup_rank(setup: RankSetup) -> str:
    """Join the process group and define rank, world_size, ... in the user namespace.

    Returns the rank's device as a string.
    """
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from IPython import get_ipython

    os.environ.update(
        RANK=str(setup.rank),
        LOCAL_RANK=str(setup.local_rank),
        WORLD_SIZE=str(setup.world_size),
        LOCAL_WORLD_SIZE=str(setup.local_world_size),
        GROUP_RANK=str(setup.group_rank),
        GROUP_WORLD_SIZE=str(setup.group_world_size),
        ROLE_RANK=str(setup.rank),
        ROLE_WORLD_SIZE=str(setup.world_size),
        MASTER_ADDR=setup.master_addr,
        MASTER_PORT=str(setup.master_port),
    )
    # gloo and NCCL listen on the interface of the address the other ranks reach (loopback on
    # one host), not on whatever the host name resolves to. A user's own choice, made before
    # %dist_start, wins.
    interface = interface_of(setup.address or setup.master_addr)
    if interface:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", interface)
    # Figures made on a rank are sent back as images, like in a notebook kernel.
    os.environ.setdefault("MPLBACKEND", INLINE_BACKEND)

    start_inspector()
    launched.as_launched_process()  # as under torchrun: Lightning's DDP then runs in the ranks
    recovery.note_engine_event_loops()
    if not debugging.notebook_debugger_installed():  # once per engine
        debugging.install_notebook_debugger()
    recovery.errors_after_a_cut_unformatted(get_ipython())
    recovery.begin_forming()

    device = torch.device(setup.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=setup.timeout_s)
    try:
        dist.init_process_group(
            backend=setup.backend,
            store=_rendezvous_store(setup, timeout),
            rank=setup.rank,
            world_size=setup.world_size,
            timeout=timeout,
        )
    finally:
        recovery.end_forming()
    shell = get_ipython()
    if take_cell_number not in shell.input_transformers_cleanup:
        shell.input_transformers_cleanup.insert(0, take_cell_number)
    shell.user_ns.update(
        rank=setup.rank,
        world_size=setup.world_size,
        local_rank=setup.local_rank,
        local_world_size=setup.local_world_size,
        node_rank=setup.group_rank,
        device=device,
        dist=dist,
        torch=torch,
    )
    return str(device)


# Whether this process has formatted a traceback through torch.distributed (inherited by the
# engines a zygote forks once it has).
_error_reports_warm = False


def warm_up_error_reports() -> None:
    """Format a traceback through torch.distributed once: IPython reads and parses each file of
    a traceback the first time it shows one (distributed_c10d.py is 6,000 lines: about 0.5 s),
    which would otherwise be paid by the first cell that raises through it. The zygote does it
    while idle, so the engines it forks after (restarts, replacements) inherit the parsed files.
    The engines of a start are forked before: a failing cell's error costs them that once (the
    errors of a recovery's cut are not formatted: see ``recovery.errors_after_a_cut_unformatted``)."""
    global _error_reports_warm
    import sys

    import torch.distributed as dist
    from IPython.core.ultratb import AutoFormattedTB

    try:
        dist.all_reduce("not a tensor")
    except TypeError:
        AutoFormattedTB(mode="Context").structured_traceback(*sys.exc_info())
    _error_reports_warm = True


def error_reports_warm() -> bool:
    return _error_reports_warm


def rejoin_process_group(setup: RankSetup) -> Rejoined:
    """After %dist_recover cut the old connections: destroy every process group of this rank
    and join a new default group as ``setup`` says (the same rank, or a new one after a
    shrink), keeping everything else in the namespace. Names holding an old group are returned
    as stale."""
    import torch.distributed as dist
    from IPython import get_ipython

    stale = recovery.stale_objects(get_ipython().user_ns)
    recovery.begin_forming()
    if dist.is_initialized():
        dist.destroy_process_group()
    return Rejoined(device=setup_rank(setup), stale=tuple(stale), cut_peers=frozenset(recovery.cut_peers))
