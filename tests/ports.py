"""A port for a program the test starts, which binds it later itself (JupyterLab, Slurm's daemons,
torchrun's store, the Jupyter kernels of nbval and of the tests).

A port the system hands out (``bind(("127.0.0.1", 0))``) comes from the ephemeral range, which
every other process's outgoing connections draw from too: between the test's closing it and the
program's binding it, someone else may take it (seen with the tests in parallel: torchrun's
``EADDRINUSE``, and a kernel that died binding its control port). So the port is chosen below
that range, where nobody is given one unasked, and checked free.

Loaded as a plugin (pyproject's addopts): jupyter_client picks a kernel's five ports by
``bind(0)`` (``LocalPortCache.find_available_port``); in the test processes it picks them here.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

from jupyter_client.connect import LocalPortCache

LOWEST = 10000


def unused_port(host: str = "127.0.0.1") -> int:
    first_ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for port in random.sample(range(LOWEST, first_ephemeral), 200):
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port between {LOWEST} and {first_ephemeral} on {host}")


def _kernel_port(cache: LocalPortCache, ip: str) -> int:
    """``LocalPortCache.find_available_port``, below the ephemeral range: a port not handed to
    another kernel of this process."""
    while (port := unused_port(ip or "127.0.0.1")) in cache.currently_used_ports:
        pass
    cache.currently_used_ports.add(port)
    return port


def pytest_configure(config) -> None:
    LocalPortCache.find_available_port = _kernel_port
