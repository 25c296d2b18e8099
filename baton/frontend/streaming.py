"""Server-sent events: for completions and chat, `data: {json}\\n\\n` chunks ending with
`data: [DONE]`; each writer says how its chunks are framed (frontend/responses_stream.py frames
typed events).

A streamed response starts once every choice's first delta is in: its admission, which the
pipeline sends when the scheduler takes the request, before its prefill (or an error). So an
error the pipeline reports up front for any choice (prompt too long, overloaded) still gets its
proper status code instead of a 200 stream, and the headers go out without waiting for the
prefill, as vLLM's do.
A client that disconnects cancels the stream: its pipeline requests are aborted.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

import msgspec
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from baton.client import ServerError
from baton.frontend.errors import OpenAIError, from_server_error
from baton.frontend.generation import IndexedDelta, UsageTotals, stats_body, unless_disconnected
from baton.frontend.logprobs import ChoiceLogprobs
from baton.frontend.params import ChoiceRequest
from baton.messages import GenerateDelta

SSE_DONE = b"data: [DONE]\n\n"
_encode = msgspec.json.Encoder().encode


def sse_event(payload: object) -> bytes:
    """One SSE data event."""
    return b"data: " + _encode(payload) + b"\n\n"


class ChunkWriter(Protocol):
    """Turns one endpoint's deltas into its chunk objects."""

    def chunks(self, index: int, delta: GenerateDelta) -> list[dict]:
        """The chunks for one delta of choice `index` (possibly none)."""
        ...

    def final_chunks(self) -> list[dict]:
        """Chunks after the last delta (the usage chunk, when asked for)."""
        ...

    # What ends the stream, after its final or error chunks.
    stream_end: bytes

    def encode(self, chunks: list[dict]) -> bytes:
        """The chunks as SSE events."""
        ...

    def error_chunks(self, error: OpenAIError) -> list[dict]:
        """The chunks that report an error once the headers are sent."""
        ...


class ChunkWriterBase:
    """What both endpoints' writers share: the chunk envelope, usage accounting and the
    framing (OpenAI's `data:` events, then `data: [DONE]`)."""

    stream_end = SSE_DONE

    def __init__(
        self,
        envelope: dict[str, object],
        choices: list[ChoiceRequest],
        include_usage: bool,
        with_logprobs: bool,
        with_stats: bool,
        *,
        as_token_ids: bool = False,
    ) -> None:
        self._envelope = envelope  # id, object, created, model
        self._groups = {choice.index: choice.group for choice in choices}
        self._include_usage = include_usage
        self._usage = UsageTotals()
        # Per choice, when logprobs were asked for (each keeps its running text offset).
        self._logprobs = (
            {choice.index: ChoiceLogprobs(as_token_ids) for choice in choices}
            if with_logprobs
            else None
        )
        self._opened: set[int] = set()  # choices that have had a chunk (chat opens each one)
        self._with_stats = with_stats

    def _chunk(self, choice: dict[str, object], delta: GenerateDelta | None = None) -> dict:
        """A chunk carrying one choice; the usage of a final `delta` is accounted."""
        if delta is not None and delta.finished:
            self._usage.add(self._groups[choice["index"]], delta.usage)  # type: ignore[index]
            if self._with_stats:
                choice["stats"] = stats_body(delta.stats)
        chunk = {**self._envelope, "choices": [choice]}
        if self._include_usage:
            chunk["usage"] = None  # as OpenAI: every chunk but the last has a null usage
        return chunk

    def final_chunks(self) -> list[dict]:
        """The usage chunk (no choices) when `stream_options.include_usage` is set."""
        if not self._include_usage:
            return []
        return [{**self._envelope, "choices": [], "usage": self._usage.body()}]

    def encode(self, chunks: list[dict]) -> bytes:
        """One `data:` event per chunk."""
        return b"".join(sse_event(chunk) for chunk in chunks)

    def error_chunks(self, error: OpenAIError) -> list[dict]:
        """The error's JSON as one chunk, as vLLM streams it."""
        return [error.payload()]


class SSEResponse(StreamingResponse):
    """A streaming response that always closes its body iterator, even when the client left
    while a chunk was being sent (so the pipeline requests are aborted at once, not at GC)."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache"})
        self._events = content

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()  # type: ignore[attr-defined]


async def stream_response(
    request: Request, deltas: AsyncIterator[IndexedDelta], writer: ChunkWriter, num_choices: int
) -> SSEResponse:
    """Wait until each of the `num_choices` choices has its first delta (errors raise here,
    before any byte is sent), then stream."""
    opening: list[IndexedDelta] = []
    try:
        started: set[int] = set()
        while len(started) < num_choices:
            indexed = await unless_disconnected(request, anext(deltas))
            opening.append(indexed)
            started.add(indexed[0])
    except BaseException:
        await deltas.aclose()  # type: ignore[attr-defined]
        raise
    return SSEResponse(_events(opening, deltas, writer))


async def _events(
    opening: list[IndexedDelta], deltas: AsyncIterator[IndexedDelta], writer: ChunkWriter
) -> AsyncIterator[bytes]:
    try:
        for index, delta in opening:
            events = writer.encode(writer.chunks(index, delta))
            if events:  # none for a chat admission, or a token whose text is held back
                yield events
        async for index, delta in deltas:
            events = writer.encode(writer.chunks(index, delta))
            if events:
                yield events
        yield writer.encode(writer.final_chunks()) + writer.stream_end
    except ServerError as error:  # headers are sent: the error goes in the stream, as vLLM does
        yield writer.encode(writer.error_chunks(from_server_error(error))) + writer.stream_end
    finally:
        await deltas.aclose()  # type: ignore[attr-defined]
