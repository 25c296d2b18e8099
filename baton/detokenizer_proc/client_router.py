"""The detokenizer's client-facing ROUTER: Hello handshakes, replies and heartbeats, whose sends
detect vanished clients, and the bound on what a client leaves unread.

A client that does not read its replies is bounded as a slow HTTP stream is, by pausing its
requests. Once the client's own receive queue and the kernel's socket buffers between them are
full, ZMQ queues at most CLIENT_SEND_HWM reply messages here for it (the socket's send
high-water mark), and a send past that fails at once (non-blocking, ROUTER_MANDATORY) instead of
growing the queue: the client is stalled. Its replies from then on wait here in its backlog, in
order, and each of its requests is paused on the scheduler for the server (`PauseRid`, holder
"server"), those that register later as their first reply comes. A paused request gets no steps,
so the backlog grows only by what was already on its way when the pause landed (a step or two
per request): the memory a client costs stops growing however long it does not read, unless it
keeps sending requests (each adds its first reply). The backlog is retried every
BACKLOG_RETRY_S; once all of it has gone out (the client read ZMQ's queue down to its low-water
mark, half the HWM, and then the backlog), its requests are resumed. Each client has a queue of
its own, so one that stalls delays no other.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum, auto

import zmq

from baton.config import BatonConfig
from baton.detokenizer_proc.service import DetokenizerService, Handled
from baton.messages import (
    ClientReply,
    Codec,
    DetokenizerClientMessage,
    Heartbeat,
    HelloAck,
    Replies,
)
from baton.process_messages import AbortRid, PauseRid, SchedulerMessage
from baton.zmq_curve import secure_client_facing

logger = logging.getLogger(__name__)

# The most reply messages ZMQ queues here for one client before it counts as not reading. A
# client gets one message per scheduler iteration (its requests' deltas together), so this is a
# quarter second of 1 ms steps, after the kernel's socket buffers and the client's own receive
# queue (ZMQ's default: 1000 messages) have filled: a client busy for a moment never meets it.
CLIENT_SEND_HWM = 256
# The most replies a stalled client's backlog holds. Its paused requests add none, but a client
# that goes on sending requests (each admitted or refused with a reply) or stats queries without
# reading would grow it for ever: past this many, it counts as gone, as a vanished client does
# (its requests aborted, its backlog dropped). Far more than paused requests leave in flight.
MAX_BACKLOG_FRAMES = 4096
# How often a stalled client's backlog is retried: ZMQ tells no one when a peer's queue drains.
# Each failed try costs an exception (see `readable`), so not on every message.
BACKLOG_RETRY_S = 0.05


def readable(socket: zmq.Socket) -> bool:
    """Whether a message waits on `socket`. Asked before each receive rather than catching
    zmq.Again after the last: building that exception was about 12 % of this process's CPU time
    (py-spy, one stream of 1 ms steps)."""
    return bool(socket.get(zmq.EVENTS) & zmq.POLLIN)


def bind_client_router(context: zmq.Context, address: str, config: BatonConfig) -> zmq.Socket:
    """The ROUTER clients connect their reply sockets to, bound at `address` (under CurveZMQ
    when `config` says so)."""
    socket = context.socket(zmq.ROUTER)
    # A send to a client that is gone or not reading fails instead of being dropped or blocking.
    socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
    socket.setsockopt(zmq.SNDHWM, CLIENT_SEND_HWM)
    secure_client_facing(socket, context, config)
    socket.bind(address)
    return socket


class _Sent(Enum):
    SENT = auto()
    FULL = auto()  # the client's queue is at CLIENT_SEND_HWM: it is not reading
    GONE = auto()  # no such peer: the client is forgotten and its requests aborted


@dataclass(slots=True)
class _Backlog:
    """A stalled client's replies that its full queue could not take, oldest first, and its
    requests paused for it."""

    frames: deque[bytes] = field(default_factory=deque)
    paused_rids: set[str] = field(default_factory=set)


class ClientRouter:
    """Routes each client its replies and heartbeats; pauses the requests of a client that does
    not read them (see the module's docstring) and aborts those of one that is gone."""

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
        self._backlogs: dict[bytes, _Backlog] = {}  # by stalled client
        self._heartbeat = self._outbound.encode(Heartbeat())

    @property
    def stalled(self) -> bool:
        """Whether some client's replies wait in a backlog (to be retried)."""
        return bool(self._backlogs)

    def answer_hellos(self) -> None:
        """Answer every Hello waiting on the socket; anything else is logged and dropped."""
        while readable(self._socket):
            frames = self._socket.recv_multipart()
            if len(frames) != 2:
                logger.warning("dropping a client message of %d frames", len(frames))
                continue
            client_id, frame = frames
            if self._inbound.decode_or_none(frame) is not None:
                self._clients.add(client_id)
                self._send(client_id, self._outbound.encode(HelloAck()))

    def send_heartbeats(self) -> None:
        """A Heartbeat to every connected client (a copy of the set: a gone one leaves it). A
        stalled client gets none: its queue is full of replies, and retrying its backlog finds
        it gone as a heartbeat would. A full queue drops the heartbeat: nothing to keep."""
        for client_id in list(self._clients):
            if client_id not in self._backlogs:
                self._send(client_id, self._heartbeat)

    def deliver(self, handled: Handled) -> None:
        """Send each client its batch (encoded once) and the scheduler its aborts."""
        for client_id, items in handled.replies.items():
            self._reply(client_id, self._outbound.encode(Replies(items=items)))
        self.send_to_scheduler(handled.to_scheduler)

    def retry_backlogs(self) -> None:
        """Send each stalled client what its queue takes now; resume the requests of each whose
        backlog has all gone out."""
        for client_id, backlog in list(self._backlogs.items()):
            sent = _Sent.SENT
            while backlog.frames:
                sent = self._send(client_id, backlog.frames[0])
                if sent is not _Sent.SENT:
                    break
                backlog.frames.popleft()
            if sent is _Sent.SENT:
                del self._backlogs[client_id]
                logger.info("client %s caught up; resuming its requests", client_id.hex())
                self.send_to_scheduler(_server_holds(backlog.paused_rids, paused=False))

    def send_to_scheduler(self, messages: list[AbortRid] | list[PauseRid]) -> None:
        """Push aborts or pauses to the scheduler."""
        for message in messages:
            self._to_scheduler.send(self._scheduler_codec.encode(message))

    def _reply(self, client_id: bytes, frame: bytes) -> None:
        """Send a client its replies, or keep them in its backlog (behind what waits there
        already, so they stay in order) and pause its requests."""
        backlog = self._backlogs.get(client_id)
        if backlog is None:
            if self._send(client_id, frame) is not _Sent.FULL:
                return
            logger.info("client %s is not reading; pausing its requests", client_id.hex())
            backlog = self._backlogs[client_id] = _Backlog()
        backlog.frames.append(frame)
        if len(backlog.frames) > MAX_BACKLOG_FRAMES:
            self._forget(client_id, f"left {MAX_BACKLOG_FRAMES} replies unread")
            return
        # Every request the client has generating, those registered since it stalled included:
        # each new one's first reply (its admission) comes through here.
        unpaused = [
            rid
            for rid in self._service.generating_rids(client_id)
            if rid not in backlog.paused_rids
        ]
        backlog.paused_rids.update(unpaused)
        self.send_to_scheduler(_server_holds(unpaused, paused=True))

    def _send(self, client_id: bytes, frame: bytes) -> _Sent:
        try:
            self._socket.send_multipart([client_id, frame], zmq.NOBLOCK)
        except zmq.ZMQError as error:
            if error.errno == zmq.EAGAIN:
                return _Sent.FULL
            if error.errno != zmq.EHOSTUNREACH:  # ROUTER_MANDATORY's "no such peer"
                raise
            self._forget(client_id, "is gone")
            return _Sent.GONE
        return _Sent.SENT

    def _forget(self, client_id: bytes, why: str) -> None:
        """Abort a client's requests and drop what waits for it."""
        logger.info("client %s %s; aborting its requests", client_id.hex(), why)
        self._clients.discard(client_id)
        self._backlogs.pop(client_id, None)
        self.send_to_scheduler(self._service.client_vanished(client_id))


def _server_holds(rids: Iterable[str], paused: bool) -> list[PauseRid]:
    """The server's pause (or resume) of each of `rids`: a client's own pause is apart."""
    return [PauseRid(rid=rid, paused=paused, holder="server") for rid in rids]
