"""Ports for processes started on this machine's loopback (tfps local, the benchmarks)."""

from __future__ import annotations

import random
import socket
from pathlib import Path

LOOPBACK = "127.0.0.1"
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_handed_out: set[int] = set()


def free_port() -> int:
    """A port free on 127.0.0.1 now, below the kernel's ephemeral range. A port from that
    range (what binding port 0 gives) can be taken by the local end of any outgoing
    connection, a worker's to another PS for one, before the process it is meant for binds it."""
    try:
        low = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(100):
        port = rng.randrange(max(1024, low - 12000), low)
        if port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((LOOPBACK, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # a crowded machine: any free port
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]
