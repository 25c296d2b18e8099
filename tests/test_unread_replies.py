"""A ZMQ client that sends requests and never reads their replies, against a launched server: its
requests are paused for the server once its replies fill the detokenizer's queue for it, so
what it leaves unread stops growing; other clients go on; it reads, and they resume and finish
whole."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
import zmq.asyncio
from helpers import free_port

from baton import SamplingParams
from baton.client import BatonClient
from baton.config import BatonConfig
from baton.launch import Server
from baton.messages import (
    ClientMessage,
    ClientReply,
    Codec,
    GenerateDelta,
    GenerateRequest,
    Hello,
    HelloAck,
    Replies,
)

PROMPTS = ["The little dog", "One day, a girl named Sue", "Lily and Tom went to the park"]
MAX_TOKENS = 480
# Top-20 logprobs make each delta about 1 KB, so the queues between the server and a client
# that does not read (the kernel's socket buffers, its own receive queue) fill in a few hundred
# steps, well before MAX_TOKENS.
PARAMS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=20)


@pytest.fixture(scope="module")
def server(stories260k_dir: Path) -> Iterator[Server]:
    config = BatonConfig(
        model=str(stories260k_dir),
        dtype="float32",
        page_size=4,
        num_pages=800,
        port=free_port(),
        log_level="warning",
    )
    with Server(config) as running:
        yield running


class _SilentClient:
    """A client of the raw protocol that sends requests and reads nothing until told to."""

    def __init__(self, context: zmq.asyncio.Context, server: Server) -> None:
        self.requests = context.socket(zmq.DEALER)
        self.replies = context.socket(zmq.DEALER)
        for socket in (self.requests, self.replies):
            socket.setsockopt(zmq.ROUTING_ID, b"silent-client")
        self.replies.setsockopt(zmq.RCVHWM, 1)  # its own queue holds next to nothing
        self.requests.connect(server.addresses.requests)
        self.replies.connect(server.addresses.replies)
        self.outbound: Codec[ClientMessage] = Codec(ClientMessage)
        self.inbound: Codec[ClientReply] = Codec(ClientReply)

    async def hello(self) -> None:
        await self.replies.send(self.outbound.encode(Hello()))
        reply = self.inbound.decode_or_none(await asyncio.wait_for(self.replies.recv(), 30))
        assert isinstance(reply, HelloAck)

    async def read_until_finished(self, count: int) -> dict[str, GenerateDelta]:
        """Read until `count` requests have finished; each request's deltas merged into one."""
        merged: dict[str, GenerateDelta] = {}
        while sum(delta.finished for delta in merged.values()) < count:
            reply = self.inbound.decode_or_none(await asyncio.wait_for(self.replies.recv(), 30))
            for item in reply.items if isinstance(reply, Replies) else []:
                assert isinstance(item, GenerateDelta)
                empty = GenerateDelta(request_id=item.request_id, token_ids=[], text="")
                delta = merged.setdefault(item.request_id, empty)
                delta.token_ids += item.token_ids
                delta.finished, delta.finish_reason = item.finished, item.finish_reason
        return merged


def test_a_client_that_never_reads_is_paused_and_resumed_once_it_reads(server: Server) -> None:
    """The silent client's requests are paused for the server while it reads nothing (they
    once ran to the end, their replies piling up in the detokenizer): the server's generated
    tokens stop growing, with its requests far from done. Another client is served meanwhile.
    Then it reads: its requests resume and finish with every token."""

    async def main():
        context = zmq.asyncio.Context()
        silent = _SilentClient(context, server)
        observer = BatonClient(server.addresses.requests, server.addresses.replies)
        await observer.connect()
        try:
            await silent.hello()
            for index, prompt in enumerate(PROMPTS):
                request = GenerateRequest(request_id=f"s{index}", prompt=prompt, params=PARAMS)
                await silent.requests.send(silent.outbound.encode(request))
            for _ in range(300):  # up to 30 s for the server to pause them
                await asyncio.sleep(0.1)
                paused = await observer.stats()
                if paused.paused_requests == len(PROMPTS):
                    break
            else:
                raise AssertionError(f"the silent client's requests were never paused: {paused}")
            await asyncio.sleep(0.3)  # the steps in flight when the pause landed end
            before = await observer.stats()
            other = await observer.generate("Once upon a time", SamplingParams(max_tokens=16))
            await asyncio.sleep(0.5)
            still = await observer.stats()
            merged = await silent.read_until_finished(len(PROMPTS))
            return before, other, still, merged, await observer.stats()
        finally:
            await observer.close()
            context.destroy(linger=0)

    before, other, still, merged, after = asyncio.run(main())
    # Paused before they were done, and nothing more generated for them while unread: the
    # other client's 16 tokens are the only ones added.
    assert before.generated_tokens < len(PROMPTS) * MAX_TOKENS
    assert still.paused_requests == len(PROMPTS)
    assert still.generated_tokens == before.generated_tokens + len(other.token_ids)
    assert other.finish_reason is not None and len(other.token_ids) == 16
    assert sorted(merged) == ["s0", "s1", "s2"]
    for delta in merged.values():
        assert (delta.finish_reason, len(delta.token_ids)) == ("length", MAX_TOKENS)
    assert after.paused_requests == after.running_requests == 0
