"""Where a server's processes listen: ipc sockets in a private directory, tcp when asked."""

from __future__ import annotations

import os
import tempfile

import msgspec


class ServerAddresses(msgspec.Struct, frozen=True, kw_only=True):
    """ZMQ endpoints of one server.

    Clients use `requests` (the tokenizer's ROUTER) and `replies` (the detokenizer's ROUTER); the
    rest are internal PULL sockets. ipc sockets live in a directory created 0700, so two servers
    never collide and other users cannot connect.
    """

    requests: str
    replies: str
    scheduler: str
    detokenizer: str
    launcher: str
    directory: str

    @classmethod
    def create(cls, tcp_host: str | None = None, tcp_port: int | None = None) -> ServerAddresses:
        """Fresh private addresses; the client-facing pair on tcp_port and tcp_port+1 if given."""
        directory = tempfile.mkdtemp(prefix="baton-")
        os.chmod(directory, 0o700)
        names = ("requests", "replies", "scheduler", "detokenizer", "launcher")
        ipc = {name: f"ipc://{directory}/{name}" for name in names}
        if tcp_port is not None:
            host = tcp_host or "127.0.0.1"
            ipc["requests"] = f"tcp://{host}:{tcp_port}"
            ipc["replies"] = f"tcp://{host}:{tcp_port + 1}"
        return cls(directory=directory, **ipc)

    def to_json(self) -> str:
        return msgspec.json.encode(self).decode()

    @classmethod
    def from_json(cls, text: str | bytes) -> ServerAddresses:
        return msgspec.json.decode(text, type=cls)
