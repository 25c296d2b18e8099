"""A data-parallel replica's load reports to the router (router_proc)."""

from __future__ import annotations

import zmq

from baton.messages import Codec
from baton.process_messages import ReplicaLoad


class LoadReporter:
    """A data-parallel replica's reports to the router (ReplicaLoad): after an iteration that
    changed its load or finished requests."""

    def __init__(self, socket: zmq.Socket, replica: int) -> None:
        self._socket = socket
        self._replica = replica
        self._codec = Codec(ReplicaLoad)
        self._last_tokens = 0
        self.finished: list[str] = []

    def report(self, tokens: int) -> None:
        if tokens == self._last_tokens and not self.finished:
            return
        load = ReplicaLoad(replica=self._replica, tokens=tokens, finished=self.finished)
        self._socket.send(self._codec.encode(load))
        self._last_tokens, self.finished = tokens, []
