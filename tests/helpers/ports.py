"""Free TCP ports on localhost for servers started by tests."""

from __future__ import annotations

import socket

from baton.bench.peers import free_port

__all__ = ["free_port", "free_port_pair"]


def free_port_pair() -> int:
    """A port P such that P and P+1 were free a moment ago."""
    for _ in range(50):
        port = free_port()
        with socket.socket() as second:
            try:
                second.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port pair")
