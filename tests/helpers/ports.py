"""Free TCP ports on localhost for servers started by tests."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port free right now on localhost."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


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
