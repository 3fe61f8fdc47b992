"""Addresses, as both sides need them: is one loopback, and which of this host's addresses faces
another host. Shared by the notebook side and the engines; imports nothing of either."""

from __future__ import annotations

import socket


def is_loopback(address: str) -> bool:
    """Whether an IPv4 address is this machine's loopback (127.0.0.0/8)."""
    return address.startswith("127.")


def address_towards(destination: str) -> str:
    """The address of this host that packets to ``destination`` leave from (the kernel's routing
    choice; connecting a UDP socket sends nothing)."""
    if is_loopback(destination):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((destination, 9))
        return sock.getsockname()[0]
