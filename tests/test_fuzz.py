"""A bounded, seeded fuzz of a live server while real requests run.

Random and mutated frames go to every ZMQ socket a client can reach (and random bytes to the
internal ones), random JSON to every HTTP route. Afterwards no process has died, every real
request completed with its exact output length, and the KV pool is idle again.
"""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import httpx
import msgspec
import pytest
import zmq
import zmq.asyncio
from helpers import free_port
from helpers.pipeline import wait_idle

from baton import SamplingParams
from baton.checkpoint.random_model import RANDOM_MODEL_NAME
from baton.client import BatonClient
from baton.config import BatonConfig
from baton.launch import Server
from baton.messages import (
    AbortRequest,
    DetokenizeRequest,
    GenerateRequest,
    Hello,
    StatsRequest,
    TokenizeRequest,
)

SEED = 0
FRAMES_PER_SOCKET = 150
HTTP_REQUESTS = 200
REAL_REQUESTS = 12
REAL_TOKENS = 24
ROUTES = [
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("GET", "/v1/models"),
    ("GET", "/server_info"),
    ("GET", "/health"),
    ("GET", "/metrics"),
    ("POST", "/v1/nowhere"),
]
FIELDS = [
    "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stop",
    "stream", "seed", "logprobs", "top_logprobs", "min_tokens", "stop_token_ids", "ignore_eos",
    "model", "stream_options", "role", "content", "tokens", "add_special_tokens", "echo",
    "prompt_logprobs", "truncate_prompt_tokens", "return_tokens_as_token_ids",
]  # fmt: skip
SPECIAL_FRAMES = [
    b"",
    b"\x81\xa4type\xa3\xed\xa0\x80",  # invalid UTF-8: once killed the tokenizer
    b"\x91" * 100_000 + b"\x01",  # deep nesting
    b"\xc1",
    msgspec.msgpack.encode({"type": "generate", "request_id": "x", "params": {"top_k": 2**63}}),
    msgspec.msgpack.encode({"type": "generate", "request_id": "y", "prompt": "a" * 100_000}),
]


def random_value(rng: random.Random, depth: int = 0) -> Any:
    """Any JSON value, biased towards the awkward: huge and negative numbers, deep nesting."""
    kind = rng.randrange(9 if depth < 4 else 6)
    if kind == 0:
        return rng.choice([0, -1, 1, 2**31, 2**63 - 1, -(2**63), 10**30])
    if kind == 1:
        return rng.choice([0.0, -0.5, 1e-30, 1e39, 3.4e38, 0.999])
    if kind == 2:
        return "".join(chr(rng.randrange(1, 0x3000)) for _ in range(rng.randrange(12)))
    if kind == 3:
        return rng.choice([True, False, None])
    if kind == 4:
        return rng.choice(["hi", "Once upon a time", "", "\u0000"])
    if kind == 5:
        return [rng.randrange(600) for _ in range(rng.randrange(6))]
    if kind == 6:
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(FIELDS): random_value(rng, depth + 1) for _ in range(rng.randrange(5))}


def random_body(rng: random.Random) -> bytes:
    """A JSON object of API fields with random values; sometimes broken JSON."""
    body = {rng.choice(FIELDS): random_value(rng) for _ in range(rng.randrange(7))}
    if rng.random() < 0.5:
        body["max_tokens"] = rng.randrange(1, 8)  # keep the requests that do start short
    encoded = json.dumps(body).encode()
    if rng.random() < 0.2:
        encoded = mutate(rng, encoded)
    return encoded


def mutate(rng: random.Random, frame: bytes) -> bytes:
    """Flip, drop or insert a few bytes, or truncate."""
    data = bytearray(frame)
    for _ in range(rng.randrange(1, 4)):
        if not data:
            break
        position = rng.randrange(len(data))
        action = rng.randrange(4)
        if action == 0:
            data[position] ^= 1 << rng.randrange(8)
        elif action == 1:
            del data[position]
        elif action == 2:
            data.insert(position, rng.randrange(256))
        else:
            del data[position:]
    return bytes(data)


def client_frames(rng: random.Random) -> list[bytes]:
    """Random bytes, mutated valid client messages, and the frames that once did harm."""
    valid = [
        msgspec.msgpack.encode(GenerateRequest(request_id="f", prompt="hi")),
        msgspec.msgpack.encode(
            GenerateRequest(request_id="g", prompt_token_ids=[1, 2], params=SamplingParams())
        ),
        msgspec.msgpack.encode(AbortRequest(request_id="nobody")),
        msgspec.msgpack.encode(StatsRequest(request_id="s")),
        msgspec.msgpack.encode(TokenizeRequest(request_id="t", prompt="hi")),
        msgspec.msgpack.encode(DetokenizeRequest(request_id="d", token_ids=[1, 2])),
        msgspec.msgpack.encode(Hello()),
    ]
    frames = list(SPECIAL_FRAMES)
    while len(frames) < FRAMES_PER_SOCKET:
        if rng.random() < 0.3:
            frames.append(rng.randbytes(rng.randrange(1, 64)))
        else:
            frames.append(mutate(rng, rng.choice(valid)))
    return frames


async def fuzz_zmq(server: Server, rng: random.Random) -> int:
    """Send every socket its frames; returns how many were sent."""
    context = zmq.asyncio.Context.instance()
    sent = 0
    addresses = server.addresses
    for address, kind in (
        (addresses.requests, zmq.DEALER),
        (addresses.replies, zmq.DEALER),
        (addresses.scheduler, zmq.PUSH),
        (addresses.detokenizer, zmq.PUSH),
    ):
        socket = context.socket(kind)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(address)
        internal = kind == zmq.PUSH
        # Internal sockets get random bytes only: a mutation could forge a valid Shutdown.
        frames = client_frames(rng) if not internal else [rng.randbytes(32)] * FRAMES_PER_SOCKET
        for frame in frames:
            if kind == zmq.DEALER and rng.random() < 0.1:
                await socket.send_multipart([frame, frame])  # two frames where one belongs
            else:
                await socket.send(frame)
            sent += 1
            await asyncio.sleep(0)
        socket.close()
    return sent


async def fuzz_http(base_url: str, rng: random.Random) -> dict[int, int]:
    """Random bodies to random routes; returns the count of each status."""
    statuses: dict[int, int] = {}
    headers = {"Content-Type": "application/json"}
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        for _ in range(HTTP_REQUESTS):
            method, path = rng.choice(ROUTES)
            if method == "GET":
                response = await http.get(path)
            else:
                response = await http.post(path, content=random_body(rng), headers=headers)
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            if response.status_code >= 400:
                assert "error" in response.json(), response.text
    return statuses


async def real_requests(server: Server) -> list[int]:
    """Greedy requests that must all complete with exactly REAL_TOKENS tokens."""
    async with BatonClient(server.addresses.requests, server.addresses.replies) as client:
        params = SamplingParams(temperature=0, max_tokens=REAL_TOKENS, ignore_eos=True)
        results = await asyncio.gather(
            *(client.generate(f"request {index}", params) for index in range(REAL_REQUESTS))
        )
        return [len(result.token_ids) for result in results]


async def idle_stats(server: Server) -> Any:
    async with BatonClient(server.addresses.requests, server.addresses.replies) as client:
        return await wait_idle(client, timeout=30.0)


@pytest.mark.slow
def test_fuzzed_server_loses_nothing() -> None:
    config = BatonConfig(
        model=RANDOM_MODEL_NAME,
        dtype="float32",
        num_pages=256,
        port=free_port(),
        max_model_len=512,
        log_level="error",
    )

    async def main(server: Server) -> tuple[int, dict[int, int], list[int]]:
        base_url = f"http://{config.host}:{config.port}"
        real = asyncio.create_task(real_requests(server))
        # One generator each: the two interleave by timing, their sequences must not.
        sent, statuses = await asyncio.gather(
            fuzz_zmq(server, random.Random(SEED)), fuzz_http(base_url, random.Random(SEED + 1))
        )
        return sent, statuses, await real

    with Server(config) as server:
        sent, statuses, lengths = asyncio.run(main(server))
        assert server.dead_child() is None
        assert lengths == [REAL_TOKENS] * REAL_REQUESTS
        stats = asyncio.run(idle_stats(server))
        assert stats.running_requests == stats.waiting_requests == stats.used_pages == 0
        assert server.dead_child() is None
    print(f"fuzz: {sent} ZMQ frames, HTTP statuses {dict(sorted(statuses.items()))}")
    assert sum(statuses.values()) == HTTP_REQUESTS and 500 not in statuses
