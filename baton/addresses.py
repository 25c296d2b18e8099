"""Where a server's processes listen: ipc sockets in a private directory, tcp when asked."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import msgspec

# A server's private directory is named after its launcher's pid, so one left behind by a killed
# launcher (kill -9 runs no cleanup) is recognisable, and removed by the next server's start.
DIRECTORY_PREFIX = "baton-"


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
    # Where data-parallel replicas report their load to the router (router_proc).
    balancer: str
    directory: str

    @classmethod
    def create(cls, tcp_host: str | None = None, tcp_port: int | None = None) -> ServerAddresses:
        """Fresh private addresses; the client-facing pair on tcp_port and tcp_port+1 if given."""
        remove_stale_directories()
        directory = tempfile.mkdtemp(prefix=f"{DIRECTORY_PREFIX}{os.getpid()}-")
        os.chmod(directory, 0o700)
        names = ("requests", "replies", "scheduler", "detokenizer", "launcher", "balancer")
        ipc = {name: f"ipc://{directory}/{name}" for name in names}
        if tcp_port is not None:
            host = tcp_host or "127.0.0.1"
            ipc["requests"] = f"tcp://{host}:{tcp_port}"
            ipc["replies"] = f"tcp://{host}:{tcp_port + 1}"
        return cls(directory=directory, **ipc)

    def replica_inbox(self, replica: int) -> str:
        """Where data-parallel replica `replica`'s scheduler (its rank 0) takes the messages the
        router sends it; `scheduler` is then the router's."""
        return f"ipc://{self.directory}/scheduler-{replica}"

    def to_json(self) -> str:
        return msgspec.json.encode(self).decode()

    @classmethod
    def from_json(cls, text: str | bytes) -> ServerAddresses:
        return msgspec.json.decode(text, type=cls)


def remove_stale_directories(parent: str | None = None) -> list[Path]:
    """Remove this user's server directories whose launcher is dead; returns what was removed."""
    removed = []
    for directory in Path(parent or tempfile.gettempdir()).glob(f"{DIRECTORY_PREFIX}*-*"):
        pid = directory.name.removeprefix(DIRECTORY_PREFIX).partition("-")[0]
        try:
            mine = directory.is_dir() and directory.stat().st_uid == os.getuid()
        except OSError:
            continue  # gone meanwhile
        if mine and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(directory, ignore_errors=True)
            removed.append(directory)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, another user's
    return True
