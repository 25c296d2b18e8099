"""A fake OpenAI-compatible streaming server with known timings, for the serving benchmark tests.

Each request streams `max_tokens` tokens: the first `ttft_s` after the request arrives, then one
every `itl_s`, scheduled on absolute times so delays do not accumulate. It runs aiohttp.web on
its own event loop in a background thread (127.0.0.1, a free port), so synchronous code such as
`serving.main` can drive it.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from aiohttp import web

# Failure modes, cycled over requests by arrival order (None = a normal response).
FAILURE_MODES = ("http500", "malformed", "disconnect", "error_event", "no_done")
_FAIL_AFTER_TOKENS = 2  # mid-stream failures happen after this many good chunks


@dataclass(frozen=True)
class FakeServerConfig:
    """How the fake server behaves."""

    ttft_s: float = 0.05
    itl_s: float = 0.01
    tokens_per_chunk: int = 1
    send_usage: bool = True
    failure_modes: Sequence[str | None] = ()
    rejected_fields: frozenset[str] = frozenset()  # 400 when present, like a strict server
    model: str = "fake-model"


@dataclass
class _Stats:
    payloads: list[dict[str, Any]] = field(default_factory=list)
    arrival_times: list[float] = field(default_factory=list)  # loop.time(), seconds
    authorizations: list[str | None] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0


def _sse(data: Any) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data)
    return f"data: {text}\n\n".encode()


def _token_chunk(text: str, chat: bool) -> dict[str, Any]:
    choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
    return {"object": "chunk", "choices": [choice]}


def _prompt_tokens(body: dict[str, Any]) -> int:
    """Ids (or words) in the prompt plus one BOS token, as real servers count it."""
    prompt = body["messages"][-1]["content"] if "messages" in body else body["prompt"]
    return (len(prompt) if isinstance(prompt, list) else len(prompt.split())) + 1


class FakeOpenAIServer:
    """Context manager: `with FakeOpenAIServer(config) as server: ... server.url ...`."""

    def __init__(self, config: FakeServerConfig | None = None) -> None:
        self.config = config or FakeServerConfig()
        self.stats = _Stats()
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None

    @property
    def payloads(self) -> list[dict[str, Any]]:
        """Request bodies received on the completion endpoints, in arrival order."""
        return self.stats.payloads

    @property
    def max_in_flight(self) -> int:
        """The most completion requests that were being handled at once."""
        return self.stats.max_in_flight

    def __enter__(self) -> FakeOpenAIServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=10)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._completions)
        self._runner = web.AppRunner(app, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.config.model}]})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        stats = self.stats
        stats.in_flight += 1
        stats.max_in_flight = max(stats.max_in_flight, stats.in_flight)
        try:
            return await self._respond(request)
        finally:
            stats.in_flight -= 1

    async def _respond(self, request: web.Request) -> web.StreamResponse:
        config, loop = self.config, asyncio.get_running_loop()
        arrival = loop.time()
        body = await request.json()
        ordinal = len(self.stats.payloads)
        self.stats.payloads.append(body)
        self.stats.arrival_times.append(arrival)
        self.stats.authorizations.append(request.headers.get("Authorization"))
        modes = config.failure_modes
        mode = modes[ordinal % len(modes)] if modes else None
        if rejected := config.rejected_fields & body.keys():
            return web.json_response({"error": f"unknown fields {sorted(rejected)}"}, status=400)
        if mode == "http500":
            return web.json_response({"error": "internal error"}, status=500)
        chat = request.path.endswith("/chat/completions")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        if chat:  # OpenAI servers open a chat stream with an empty role-only delta
            await response.write(_sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}))
        num_tokens = body["max_tokens"]
        for first in range(0, num_tokens, config.tokens_per_chunk):
            count = min(config.tokens_per_chunk, num_tokens - first)
            last = first + count - 1
            await asyncio.sleep(
                max(0.0, arrival + config.ttft_s + last * config.itl_s - loop.time())
            )
            if first >= _FAIL_AFTER_TOKENS and mode in ("malformed", "disconnect", "error_event"):
                return await self._fail_mid_stream(request, response, mode)
            await response.write(_sse(_token_chunk("tok " * count, chat)))
        if config.send_usage:
            usage = {"prompt_tokens": _prompt_tokens(body), "completion_tokens": num_tokens}
            await response.write(_sse({"choices": [], "usage": usage}))
        if mode != "no_done":
            await response.write(_sse("[DONE]"))
        await response.write_eof()
        return response

    async def _fail_mid_stream(
        self, request: web.Request, response: web.StreamResponse, mode: str
    ) -> web.StreamResponse:
        if mode == "disconnect":
            assert request.transport is not None
            request.transport.close()
            return response
        if mode == "malformed":
            await response.write(b"data: {this is not json\n\n")
        else:
            await response.write(_sse({"error": {"message": "engine died", "code": 500}}))
        await response.write(_sse("[DONE]"))
        await response.write_eof()
        return response
