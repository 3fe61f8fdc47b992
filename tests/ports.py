"""A port for a program the test starts, which binds it later itself (JupyterLab, Slurm's daemons,
torchrun's store).

A port the system hands out (``bind(("127.0.0.1", 0))``) comes from the ephemeral range, which
every other process's outgoing connections draw from too: between the test's closing it and the
program's binding it, someone else may take it (seen with the tests in parallel: torchrun's
``EADDRINUSE``). So the port is chosen below that range, where nobody is given one unasked, and
checked free.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

LOWEST = 10000


def unused_port() -> int:
    first_ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for port in random.sample(range(LOWEST, first_ephemeral), 200):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port between {LOWEST} and {first_ephemeral} on 127.0.0.1")
