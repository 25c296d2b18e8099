"""An async Python client of a Baton server over ZMQ.

```python
async with BatonClient(requests_address, replies_address) as client:
    result = await client.generate("Once upon a time", SamplingParams(max_tokens=32))
    async with contextlib.aclosing(client.stream("Hi", SamplingParams())) as deltas:
        async for delta in deltas:
            print(delta.text, end="")
```
Cancelling a `generate` task, or closing a stream before it finished, aborts the request on the
server. A stream whose reader falls behind is paused on the server and resumed once read
(backpressure: client_connection.py).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from baton.chat_options import ChatOptions
from baton.client_connection import ClientConnection
from baton.messages import (
    AbortRequest,
    ChatMessage,
    DetokenizeRequest,
    ErrorCode,
    ErrorReply,
    FinishReason,
    GenerateDelta,
    GenerateRequest,
    LogprobEntry,
    PromptLogprobs,
    StatsReply,
    StatsRequest,
    TokenizeReply,
    TokenizeRequest,
    Usage,
)
from baton.sampling_params import SamplingParams
from baton.scheduler_stats import AggregateStats, RequestStats


class ServerError(Exception):
    """A typed error from the server: `code` is invalid_request, prompt_too_long, overloaded..."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


@dataclass
class GenerateResult:
    """A finished request, as `generate` returns it."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    logprobs: list[LogprobEntry] | None = None
    prompt_logprobs: PromptLogprobs | None = None  # with `SamplingParams.prompt_logprobs`
    usage: Usage | None = None
    stats: RequestStats | None = None


class BatonClient(ClientConnection):
    """Sends requests to a server and reads their replies (the sockets: `ClientConnection`)."""

    async def __aenter__(self) -> BatonClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def stream(
        self,
        prompt: str | list[int] | list[ChatMessage],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        deadline_ms: float | None = None,
        return_stats: bool = False,
        chat: ChatOptions | None = None,
        *,
        add_special_tokens: bool = True,
    ) -> AsyncIterator[GenerateDelta]:
        """Yield the request's deltas as they come: the first, an `admission` carrying nothing
        else, once the scheduler has taken the request (before its prefill); the last has
        `finished` set.

        A prompt is text, token ids, or chat messages (rendered under `chat`, vLLM's chat
        template options); `priority` and `deadline_ms` matter under the server's
        --scheduling-policy (a priority other than 0 needs the priority policy). The last delta
        has the request's stats, but when a stop string ended the request only with
        `return_stats` (it then comes one step later). `add_special_tokens` is vLLM's: whether a
        text prompt gets the tokenizer's BOS and the like.
        Raises ServerError on a typed error.
        """
        request_id = request_id or uuid.uuid4().hex
        request = GenerateRequest(
            request_id=request_id,
            params=params or SamplingParams(),
            priority=priority,
            deadline_ms=deadline_ms,
            return_stats=return_stats,
            chat=chat or ChatOptions(),
            add_special_tokens=add_special_tokens,
        )
        if isinstance(prompt, str):
            request.prompt = prompt
        elif prompt and isinstance(prompt[0], ChatMessage):
            request.messages = list(prompt)
        else:
            request.prompt_token_ids = list(prompt)
        if request_id in self._queues:
            # Refused here, before it could take the first request's reply queue (which would
            # leave the first waiting forever): the server refuses duplicates too.
            raise ServerError("invalid_request", f"request_id {request_id!r} is already running")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        finished = False
        try:
            await self._requests.send(self._encoder.encode(request))
            while not finished:
                item = await queue.get()
                self._taken(request_id, queue)
                if isinstance(item, ErrorReply):
                    finished = True
                    raise ServerError(item.code, item.message)
                finished = item.finished
                yield item
        finally:
            del self._queues[request_id]
            self._paused.discard(request_id)
            # Cancelled or closed early: free the server-side request, unless this client is
            # closed already (the server then finds it gone and aborts the request itself).
            if not finished and not self._requests.closed:
                self._requests.send(self._encoder.encode(AbortRequest(request_id=request_id)))

    async def generate(
        self,
        prompt: str | list[int] | list[ChatMessage],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        deadline_ms: float | None = None,
        return_stats: bool = False,
        chat: ChatOptions | None = None,
        *,
        add_special_tokens: bool = True,
    ) -> GenerateResult:
        """Run a request to completion and return its output (the options: see `stream`)."""
        result: GenerateResult | None = None
        stream = self.stream(
            prompt,
            params,
            request_id,
            priority,
            deadline_ms,
            return_stats,
            chat,
            add_special_tokens=add_special_tokens,
        )
        try:
            async for delta in stream:
                result = result or GenerateResult(delta.request_id)
                result.token_ids.extend(delta.token_ids)
                result.text += delta.text
                if delta.logprobs is not None:
                    result.logprobs = (result.logprobs or []) + delta.logprobs
                if delta.prompt_logprobs is not None:
                    result.prompt_logprobs = delta.prompt_logprobs
                if delta.finished:
                    result.finish_reason = delta.finish_reason
                    result.usage = delta.usage
                    result.stats = delta.stats
        finally:
            await stream.aclose()
        assert result is not None  # a stream ends with a finished delta or raises
        return result

    async def abort(self, request_id: str) -> None:
        """Abort a request by id (its stream then ends with finish_reason "abort")."""
        await self._requests.send(self._encoder.encode(AbortRequest(request_id=request_id)))

    async def stats(self) -> AggregateStats:
        """The scheduler's aggregate stats."""
        reply = await self._round_trip(StatsRequest(request_id=uuid.uuid4().hex))
        assert isinstance(reply, StatsReply)
        return reply.stats

    async def tokenize(
        self,
        prompt: str | list[ChatMessage],
        *,
        add_special_tokens: bool = True,
        chat: ChatOptions | None = None,
        return_token_strs: bool = False,
    ) -> TokenizeReply:
        """The token ids of a text, or of chat messages rendered under `chat` (the reply's text
        is the rendered prompt), as the server would tokenize that prompt (vLLM's /tokenize);
        with `return_token_strs`, their vocabulary entries too. Raises ServerError on a typed
        error."""
        request = TokenizeRequest(
            request_id=uuid.uuid4().hex,
            chat=chat or ChatOptions(),
            return_token_strs=return_token_strs,
        )
        if isinstance(prompt, str):
            request.prompt, request.add_special_tokens = prompt, add_special_tokens
        else:
            request.messages = list(prompt)
        reply = await self._round_trip(request)
        assert isinstance(reply, TokenizeReply)
        return reply

    async def detokenize(self, token_ids: list[int]) -> str:
        """The text of `token_ids`, special tokens kept (vLLM's /detokenize)."""
        request = DetokenizeRequest(request_id=uuid.uuid4().hex, token_ids=list(token_ids))
        reply = await self._round_trip(request)
        assert isinstance(reply, TokenizeReply)
        return reply.text

    async def _round_trip(
        self, request: StatsRequest | TokenizeRequest | DetokenizeRequest
    ) -> StatsReply | TokenizeReply:
        """Send a request that has one reply and wait for it; ServerError for an error reply."""
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request.request_id] = queue
        try:
            await self._requests.send(self._encoder.encode(request))
            reply = await queue.get()
        finally:
            del self._queues[request.request_id]
        if isinstance(reply, ErrorReply):
            raise ServerError(reply.code, reply.message)
        return reply
