"""The detokenizer's ROUTER with real ZMQ sockets: a client that stops reading has its requests
paused for the server, loses no reply, and has them resumed once it has read."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq
from helpers.detokenizer import CLIENT_A, CLIENT_B, encode, request_started, step_output

from baton.checkpoint.tokenizer import Tokenizer
from baton.config import BatonConfig
from baton.detokenizer_proc import client_router
from baton.detokenizer_proc.client_router import ClientRouter, bind_client_router
from baton.detokenizer_proc.service import DetokenizerService
from baton.messages import ClientReply, Codec, GenerateDelta, Hello, HelloAck, Replies
from baton.process_messages import (
    AbortRid,
    PauseRid,
    SchedulerMessage,
    SchedulerOutputs,
    make_rid,
)

CHUNK_TEXT = "a paused stream keeps its place. " * 3  # about 300 bytes a delta
MAX_STEPS = 20_000  # far more than the queues on the way hold (a few thousand such messages)


class _Wiring:
    """A ClientRouter on real sockets: a fake scheduler's inbox and two clients' DEALERs."""

    def __init__(self, directory: Path, tokenizer: Tokenizer) -> None:
        self.context = zmq.Context()
        self.service = DetokenizerService(tokenizer)
        replies_address = f"ipc://{directory}/replies"
        socket = bind_client_router(self.context, replies_address, BatonConfig())
        self.scheduler = self.context.socket(zmq.PULL)
        self.scheduler.bind(f"ipc://{directory}/scheduler")
        to_scheduler = self.context.socket(zmq.PUSH)
        to_scheduler.connect(f"ipc://{directory}/scheduler")
        self.router = ClientRouter(socket, self.service, to_scheduler)
        self.socket = socket
        self.clients: dict[bytes, zmq.Socket] = {}
        for client_id in (CLIENT_A, CLIENT_B):
            client = self.context.socket(zmq.DEALER)
            client.setsockopt(zmq.ROUTING_ID, client_id)
            client.setsockopt(zmq.RCVHWM, 1)  # the queues on the way fill sooner
            client.connect(replies_address)
            self.clients[client_id] = client
        self.codec: Codec[ClientReply] = Codec(ClientReply)
        self.scheduler_codec: Codec[SchedulerMessage] = Codec(SchedulerMessage)

    def hello(self, client_id: bytes) -> None:
        client = self.clients[client_id]
        client.send(Codec(Hello).encode(Hello()))
        assert self.socket.poll(5000)
        self.router.answer_hellos()
        assert client.poll(5000)
        assert isinstance(self.codec.decode_or_none(client.recv()), HelloAck)

    def deliver(self, message: SchedulerOutputs) -> None:
        self.router.deliver(self.service.handle_message(message))

    def read(self, client_id: bytes) -> list[GenerateDelta]:
        """The deltas waiting for a client now (heartbeats skipped)."""
        deltas = []
        client = self.clients[client_id]
        while client.poll(0):
            reply = self.codec.decode_or_none(client.recv())
            if isinstance(reply, Replies):
                deltas += [item for item in reply.items if isinstance(item, GenerateDelta)]
        return deltas

    def read_until(
        self, client_id: bytes, done: Callable[[list[GenerateDelta]], bool], timeout: float = 10.0
    ) -> list[GenerateDelta]:
        """The deltas for a client until `done` holds for them (or `timeout` seconds): what
        was sent may still be on its way, the more so on a loaded machine."""
        deltas = self.read(client_id)
        deadline = time.monotonic() + timeout
        while not done(deltas) and time.monotonic() < deadline:
            if self.clients[client_id].poll(50):
                deltas += self.read(client_id)
        return deltas

    def to_scheduler(self, at_least: int = 0) -> list[SchedulerMessage]:
        """What the router has sent the scheduler so far: the first `at_least` messages waited
        for up to 10 s each, then whatever follows within 100 ms of the one before."""
        messages = []
        while self.scheduler.poll(10_000 if len(messages) < at_least else 100):
            messages.append(self.scheduler_codec.decode_or_none(self.scheduler.recv()))
        return messages

    def pauses(self, at_least: int = 0) -> list[PauseRid]:
        """What the router has sent the scheduler so far, all of it pauses here."""
        messages = self.to_scheduler(at_least)
        assert all(isinstance(message, PauseRid) for message in messages)
        return messages


@pytest.fixture
def wiring(tmp_path: Path, tokenizer: Tokenizer) -> Iterator[_Wiring]:
    wired = _Wiring(tmp_path, tokenizer)
    try:
        yield wired
    finally:
        wired.context.destroy(linger=0)


def _texts(deltas: list[GenerateDelta]) -> dict[str, str]:
    texts: dict[str, str] = {}
    for delta in deltas:
        texts[delta.request_id] = texts.get(delta.request_id, "") + delta.text
    return texts


def test_a_client_that_stops_reading_is_paused_for_the_server_and_resumed_once_it_reads(
    wiring: _Wiring, tokenizer: Tokenizer
) -> None:
    """Client A stops reading: once its queue here is full, its requests are paused for the
    server (not by its own hold), one that registers meanwhile too; its later replies wait in
    order and none is lost; client B, reading, is never paused. Once A reads, everything it
    was sent arrives and its requests are resumed. (The queue was once unbounded: A's replies
    piled up in the detokenizer for as long as it did not read.)"""
    for client_id in (CLIENT_A, CLIENT_B):
        wiring.hello(client_id)
    chunk = encode(tokenizer, CHUNK_TEXT)
    started = [
        request_started(CLIENT_A, "r1", []),
        request_started(CLIENT_A, "r2", []),
        request_started(CLIENT_B, "b1", []),
    ]
    wiring.deliver(SchedulerOutputs(started=started))
    steps = [step_output(CLIENT_A, request_id, chunk) for request_id in ("r1", "r2")]
    read_by_b: list[GenerateDelta] = []
    pauses: list[PauseRid] = []
    sent_steps = 0
    while not pauses and sent_steps < MAX_STEPS:
        wiring.deliver(SchedulerOutputs(steps=[*steps, step_output(CLIENT_B, "b1", chunk)]))
        sent_steps += 1
        read_by_b += wiring.read(CLIENT_B)
        if sent_steps % 100 == 0:
            pauses = wiring.pauses()
    pauses = pauses or wiring.pauses(at_least=2)
    rids = {make_rid(CLIENT_A, "r1"), make_rid(CLIENT_A, "r2")}
    assert {(p.rid, p.paused, p.holder) for p in pauses} == {(r, True, "server") for r in rids}
    assert wiring.router.stalled and sent_steps < MAX_STEPS

    # The steps in flight when the pause landed, and a request admitted meanwhile: held here.
    wiring.deliver(SchedulerOutputs(steps=steps))
    wiring.deliver(SchedulerOutputs(started=[request_started(CLIENT_A, "r3", [])]))
    assert wiring.pauses(at_least=1) == [
        PauseRid(rid=make_rid(CLIENT_A, "r3"), paused=True, holder="server")
    ]
    final = [step_output(CLIENT_A, "r3", chunk, reason="length")]
    wiring.deliver(SchedulerOutputs(steps=final))
    expected_b = CHUNK_TEXT * sent_steps
    read_by_b += wiring.read_until(
        CLIENT_B, lambda more: len(_texts(read_by_b + more).get("b1", "")) >= len(expected_b)
    )
    assert _texts(read_by_b) == {"b1": expected_b}

    read_by_a: list[GenerateDelta] = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # A reads; the router retries its backlog meanwhile
        read_by_a += wiring.read(CLIENT_A)
        wiring.router.retry_backlogs()
        if not wiring.router.stalled and read_by_a and read_by_a[-1].finished:
            break
        wiring.clients[CLIENT_A].poll(10)
    assert not wiring.router.stalled
    assert _texts(read_by_a) == {
        "r1": CHUNK_TEXT * (sent_steps + 1),
        "r2": CHUNK_TEXT * (sent_steps + 1),
        "r3": CHUNK_TEXT,
    }
    resumed = wiring.pauses(at_least=3)
    assert {(p.rid, p.paused, p.holder) for p in resumed} == {
        (rid, False, "server") for rid in (*rids, make_rid(CLIENT_A, "r3"))
    }


def test_a_stalled_client_whose_backlog_passes_its_bound_counts_as_gone(
    wiring: _Wiring, tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that never reads but keeps getting replies (new requests, each admitted with a
    reply) cannot grow its backlog past MAX_BACKLOG_FRAMES: past it, its requests are aborted
    and its backlog dropped, as for a client that vanished; the other client goes on."""
    monkeypatch.setattr(client_router, "MAX_BACKLOG_FRAMES", 8)
    for client_id in (CLIENT_A, CLIENT_B):
        wiring.hello(client_id)
    chunk = encode(tokenizer, CHUNK_TEXT)
    wiring.deliver(SchedulerOutputs(started=[request_started(CLIENT_A, "r1", [])]))
    sent_steps = 0
    while not wiring.router.stalled and sent_steps < MAX_STEPS:
        wiring.deliver(SchedulerOutputs(steps=[step_output(CLIENT_A, "r1", chunk)]))
        sent_steps += 1
    assert wiring.router.stalled
    for index in range(8):  # new requests, each with its first reply held in the backlog
        wiring.deliver(SchedulerOutputs(started=[request_started(CLIENT_A, f"n{index}", [])]))
    assert not wiring.router.stalled  # the backlog is gone with the client
    messages = wiring.to_scheduler(at_least=1)
    aborted = {message.rid for message in messages if isinstance(message, AbortRid)}
    assert make_rid(CLIENT_A, "r1") in aborted
    wiring.deliver(SchedulerOutputs(started=[request_started(CLIENT_B, "b1", [])]))
    wiring.deliver(SchedulerOutputs(steps=[step_output(CLIENT_B, "b1", chunk)]))
    read_by_b: list[GenerateDelta] = []
    while wiring.clients[CLIENT_B].poll(500):  # both replies are on their way
        read_by_b += wiring.read(CLIENT_B)
    assert _texts(read_by_b) == {"b1": CHUNK_TEXT}
