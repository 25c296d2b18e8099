"""The detokenizer process: runs the DetokenizerService on the scheduler's outputs and routes
every reply.

Each client has a DEALER (routing id = its `client_id`) connected to this process's ROUTER; replies
are batched per client per handled message.
"""

from __future__ import annotations

import logging
import time

import zmq

from baton.addresses import ServerAddresses
from baton.checkpoint.load import load_checkpoint
from baton.child_process import IDLE_POLL_MS, ReadyReporter
from baton.config import BatonConfig
from baton.detokenizer_proc.service import DetokenizerService, Handled
from baton.messages import (
    HEARTBEAT_INTERVAL_S,
    ClientReply,
    Codec,
    DetokenizerClientMessage,
    Heartbeat,
    HelloAck,
    Replies,
)
from baton.process_messages import AbortRid, DetokenizerMessage, SchedulerMessage, Shutdown

logger = logging.getLogger(__name__)


def _readable(socket: zmq.Socket) -> bool:
    """Whether a message waits on `socket`. Asked before each receive rather than catching
    zmq.Again after the last: building that exception was about 12 % of this process's CPU time
    (py-spy, one stream of 1 ms steps)."""
    return bool(socket.get(zmq.EVENTS) & zmq.POLLIN)


class _ClientRouter:
    """The client-facing ROUTER: Hello handshakes, replies and heartbeats, whose sends detect
    vanished clients."""

    def __init__(
        self, socket: zmq.Socket, service: DetokenizerService, to_scheduler: zmq.Socket
    ) -> None:
        self._socket = socket
        self._service = service
        self._to_scheduler = to_scheduler
        self._inbound: Codec[DetokenizerClientMessage] = Codec(DetokenizerClientMessage)
        self._outbound: Codec[ClientReply] = Codec(ClientReply)
        self._scheduler_codec: Codec[SchedulerMessage] = Codec(SchedulerMessage)
        self._clients: set[bytes] = set()  # those that said Hello and are not known gone
        self._heartbeat = self._outbound.encode(Heartbeat())

    def answer_hellos(self) -> None:
        """Answer every Hello waiting on the socket; anything else is logged and dropped."""
        while _readable(self._socket):
            frames = self._socket.recv_multipart()
            if len(frames) != 2:
                logger.warning("dropping a client message of %d frames", len(frames))
                continue
            client_id, frame = frames
            if self._inbound.decode_or_none(frame) is not None:
                self._clients.add(client_id)
                self._send(client_id, self._outbound.encode(HelloAck()))

    def send_heartbeats(self) -> None:
        """A Heartbeat to every connected client (a copy of the set: a gone one leaves it)."""
        for client_id in list(self._clients):
            self._send(client_id, self._heartbeat)

    def deliver(self, handled: Handled) -> None:
        """Send each client its batch (encoded once) and the scheduler its aborts."""
        for client_id, items in handled.replies.items():
            self._send(client_id, self._outbound.encode(Replies(items=items)))
        self.send_to_scheduler(handled.to_scheduler)

    def send_to_scheduler(self, messages: list[AbortRid]) -> None:
        """Push aborts to the scheduler."""
        for message in messages:
            self._to_scheduler.send(self._scheduler_codec.encode(message))

    def _send(self, client_id: bytes, frame: bytes) -> None:
        try:
            self._socket.send_multipart([client_id, frame], zmq.NOBLOCK)
        except zmq.ZMQError as error:
            # ROUTER_MANDATORY turns "no such peer" into EHOSTUNREACH; EAGAIN (a full queue)
            # cannot happen with the unlimited send queue, but would mean the same: not reading.
            if error.errno not in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                raise
            logger.info("client %s is gone; aborting its requests", client_id.hex())
            self._clients.discard(client_id)
            self.send_to_scheduler(self._service.client_vanished(client_id))


def serve(
    config: BatonConfig, addresses: ServerAddresses, context: zmq.Context, reporter: ReadyReporter
) -> None:
    """Bind, report ready, then translate and route messages until Shutdown."""
    service = DetokenizerService(load_checkpoint(config.model).tokenizer)
    inbox = context.socket(zmq.PULL)
    inbox.bind(addresses.detokenizer)
    replies = context.socket(zmq.ROUTER)
    replies.setsockopt(zmq.ROUTER_MANDATORY, 1)
    # A client slow to read must neither stall the others nor lose replies: queue without limit.
    replies.setsockopt(zmq.SNDHWM, 0)
    replies.bind(addresses.replies)
    to_scheduler = context.socket(zmq.PUSH)
    to_scheduler.connect(addresses.scheduler)
    router = _ClientRouter(replies, service, to_scheduler)
    inbound: Codec[DetokenizerMessage] = Codec(DetokenizerMessage)
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    poller.register(replies, zmq.POLLIN)
    reporter.ready()
    next_heartbeat = time.monotonic()
    while True:
        events = dict(poller.poll(min(IDLE_POLL_MS, int(HEARTBEAT_INTERVAL_S * 1000))))
        if time.monotonic() >= next_heartbeat:
            router.send_heartbeats()
            next_heartbeat = time.monotonic() + HEARTBEAT_INTERVAL_S
        if replies in events:
            router.answer_hellos()
        if inbox not in events:
            continue
        while _readable(inbox):
            message = inbound.decode_or_none(inbox.recv())
            if isinstance(message, Shutdown):
                logger.info("shutting down")
                return
            if message is not None:
                router.deliver(service.handle_message(message))
