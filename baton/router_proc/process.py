"""The router process: binds the scheduler's address in front of the data-parallel replicas
and hands each message on (balancer.py chooses a request's replica)."""

from __future__ import annotations

import logging

import zmq

from baton.addresses import ServerAddresses
from baton.child_process import IDLE_POLL_MS, ReadyReporter, run_child
from baton.config import BatonConfig
from baton.messages import Codec
from baton.process_messages import (
    AbortRid,
    PauseRid,
    ReplicaLoad,
    SchedulerMessage,
    Shutdown,
    TokenizedRequest,
)
from baton.router_proc.balancer import ReplicaBalancer

logger = logging.getLogger(__name__)


class Router:
    """Where each message for the scheduler goes: a request to the replica its balancer
    chooses, an abort or pause to the replica running that request (to all, for one the
    router no longer knows), anything else (stats requests, Shutdown) to every replica."""

    def __init__(self, replicas: list[zmq.Socket], method: str) -> None:
        self._replicas = replicas
        self.balancer = ReplicaBalancer(len(replicas), method)
        # rid -> replica, until the replica reports the request finished.
        self.owners: dict[str, int] = {}
        self._inbound = Codec(SchedulerMessage)

    def route(self, frame: bytes) -> bool:
        """Hand one frame on (as it came: replicas decode it themselves); False on Shutdown."""
        message = self._inbound.decode_or_none(frame)
        if message is None:
            return True
        if isinstance(message, TokenizedRequest):
            replica = self.balancer.choose(message.prompt_token_ids, message.params.max_tokens or 0)
            self.owners[message.rid] = replica
            self._replicas[replica].send(frame)
        elif isinstance(message, (AbortRid, PauseRid)) and message.rid in self.owners:
            self._replicas[self.owners[message.rid]].send(frame)
        else:
            for replica in self._replicas:
                replica.send(frame)
        return not isinstance(message, Shutdown)

    def reported(self, load: ReplicaLoad) -> None:
        self.balancer.reported(load.replica, load.tokens)
        for rid in load.finished:
            self.owners.pop(rid, None)


def serve(
    config: BatonConfig, addresses: ServerAddresses, context: zmq.Context, reporter: ReadyReporter
) -> None:
    """Bind the scheduler's address and the replicas' load reports, report ready, then route
    until Shutdown."""
    inbox = context.socket(zmq.PULL)
    inbox.bind(addresses.scheduler)
    loads = context.socket(zmq.PULL)
    loads.bind(addresses.balancer)
    replicas = []
    for replica in range(config.data_parallel_size):
        socket = context.socket(zmq.PUSH)
        socket.connect(addresses.replica_inbox(replica))
        replicas.append(socket)
    router = Router(replicas, config.load_balance_method)
    load_codec = Codec(ReplicaLoad)
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    poller.register(loads, zmq.POLLIN)
    reporter.ready()
    while True:
        events = dict(poller.poll(IDLE_POLL_MS))
        # Loads first: a request arriving with them goes by the freshest figures.
        while loads in events and loads.poll(0):
            load = load_codec.decode_or_none(loads.recv())
            if load is not None:
                router.reported(load)
        while inbox in events and inbox.poll(0):
            if not router.route(inbox.recv()):
                return


def main() -> None:
    """Entry point of `python -m baton.router_proc`."""
    run_child("router", serve)
