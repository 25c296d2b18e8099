"""A client's connection to a Baton server over ZMQ: its two sockets, the handshake, and the
replies routed to each open request's queue.

Liveness: the server sends a Heartbeat every second; when a client with open requests hears
nothing for SERVER_SILENCE_S (the server died or was stopped), they end with a typed
"unavailable" error instead of waiting forever.

Backpressure: a request whose reader falls behind (PAUSE_AT_UNREAD deltas unread) is paused on the
server, which keeps its pages but computes nothing more for it, and resumed once read. Any number
of clients may talk to one server; each gets only its own replies.

Security: a server on tcp with CurveZMQ (--zmq-curve-secret-key-file) encrypts both sockets and
admits only the client key pairs it lists; such a client is given `curve` (zmq_curve.py).
"""

from __future__ import annotations

import asyncio
import uuid

import zmq
import zmq.asyncio

from baton.messages import (
    HEARTBEAT_INTERVAL_S,
    AbortRequest,
    ClientMessage,
    ClientReply,
    Codec,
    ErrorCode,
    ErrorReply,
    Heartbeat,
    Hello,
    HelloAck,
    PauseRequest,
)
from baton.zmq_curve import CurveClientKeys

# Backpressure: a request with this many deltas its reader has not taken is paused on the server,
# and resumed once no more than RESUME_AT_UNREAD are left.
PAUSE_AT_UNREAD = 64
RESUME_AT_UNREAD = 8
# Open requests fail after this long without a word from the server (heartbeats included).
SERVER_SILENCE_S = 10 * HEARTBEAT_INTERVAL_S
_UNANSWERED_CURVE_HINT = (
    " (CurveZMQ: is it the server's public key, and this client's public key among the "
    "server's --zmq-curve-allowed-clients?)"
)


class ClientConnection:
    """Talks to a server's tokenizer (requests) and detokenizer (replies) sockets; `BatonClient`
    adds the requests."""

    def __init__(
        self,
        requests: str,
        replies: str,
        server_silence_s: float = SERVER_SILENCE_S,
        curve: CurveClientKeys | None = None,
    ) -> None:
        """`curve`: the keys of a server that speaks CurveZMQ (--zmq-curve-secret-key-file)."""
        self._addresses = (requests, replies)
        self._server_silence_s = server_silence_s
        self._curve = curve
        self.client_id = uuid.uuid4().bytes
        self._context = zmq.asyncio.Context()
        self._requests = self._context.socket(zmq.DEALER)
        self._replies = self._context.socket(zmq.DEALER)
        for socket in (self._requests, self._replies):
            socket.setsockopt(zmq.ROUTING_ID, self.client_id)
            socket.setsockopt(zmq.LINGER, 0)
            if curve is not None:
                curve.apply(socket)
        self._encoder = Codec(ClientMessage)
        self._decoder = Codec(ClientReply)
        self._queues: dict[str, asyncio.Queue] = {}
        self._paused: set[str] = set()  # requests paused on the server for their slow reader
        self._receiver: asyncio.Task | None = None
        self._watchdog: asyncio.Task | None = None
        self._last_heard = 0.0  # the event loop's time of the server's last message

    async def connect(self, timeout: float = 30.0) -> None:
        """Connect and wait until the server can route replies to this client."""
        requests, replies = self._addresses
        self._requests.connect(requests)
        self._replies.connect(replies)
        acked = False
        deadline = asyncio.get_running_loop().time() + timeout
        while not acked:
            if asyncio.get_running_loop().time() > deadline:
                # A CurveZMQ server drops a handshake it refuses without a word.
                hint = "" if self._curve is None else _UNANSWERED_CURVE_HINT
                raise TimeoutError(f"no answer from {replies}{hint}")
            try:
                # Bounded: a send waits while no handshake has succeeded, which for a server
                # that refuses this client's keys is forever.
                await asyncio.wait_for(self._replies.send(self._encoder.encode(Hello())), 0.5)
            except asyncio.TimeoutError:  # TimeoutError itself from Python 3.11 on
                continue
            if await self._replies.poll(500):
                acked = isinstance(
                    self._decoder.decode_or_none(await self._replies.recv()), HelloAck
                )
        self._last_heard = asyncio.get_running_loop().time()
        self._receiver = asyncio.create_task(self._receive())
        self._watchdog = asyncio.create_task(self._watch())

    async def close(self) -> None:
        for task in (self._receiver, self._watchdog):
            if task is not None:
                task.cancel()
        self._requests.close()
        self._replies.close()
        self._context.term()

    def fail_open_requests(self, code: ErrorCode, message: str) -> int:
        """End every open request of this client (stats round trips included) with
        ServerError(code, message) and abort it on the server. Returns how many there were."""
        for request_id, queue in self._queues.items():
            queue.put_nowait(ErrorReply(request_id=request_id, code=code, message=message))
            # The stream ends on an error as on a finished request, sending no abort itself.
            self._requests.send(self._encoder.encode(AbortRequest(request_id=request_id)))
        return len(self._queues)

    async def _receive(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            reply = self._decoder.decode_or_none(await self._replies.recv())
            self._last_heard = loop.time()
            if reply is None or isinstance(reply, HelloAck | Heartbeat):
                continue
            for item in reply.items:
                queue = self._queues.get(item.request_id)
                if queue is None:
                    continue
                queue.put_nowait(item)
                if queue.qsize() >= PAUSE_AT_UNREAD and item.request_id not in self._paused:
                    self._set_paused(item.request_id, True)

    async def _watch(self) -> None:
        """Fail the open requests once the server has been silent for SERVER_SILENCE_S."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)
            silent = loop.time() - self._last_heard
            # A message already waiting (this loop was busy, not the server) is not silence.
            waiting = self._replies.get(zmq.EVENTS) & zmq.POLLIN
            if self._queues and silent > self._server_silence_s and not waiting:
                self.fail_open_requests(
                    "unavailable", f"the server has not answered for {silent:.0f} s"
                )
                self._last_heard = loop.time()  # once per silence, not every second

    def _set_paused(self, request_id: str, paused: bool) -> None:
        if paused:
            self._paused.add(request_id)
        else:
            self._paused.discard(request_id)
        self._requests.send(
            self._encoder.encode(PauseRequest(request_id=request_id, paused=paused))
        )

    def _taken(self, request_id: str, queue: asyncio.Queue) -> None:
        """Its reader took one of the request's deltas: resume the request if it is paused and
        few enough are left."""
        if request_id in self._paused and queue.qsize() <= RESUME_AT_UNREAD:
            self._set_paused(request_id, False)
