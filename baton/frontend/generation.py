"""Running an API request's choices on the pipeline through the frontend's `BatonClient`.

Every choice is one pipeline request. Closing or cancelling what this module returns closes the
client's streams, which aborts the requests server-side, so their KV pages come back.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import TypeVar

import msgspec
from starlette.requests import Request

from baton.frontend.echo import prompt_echo
from baton.frontend.errors import ClientGone
from baton.frontend.params import ChoiceRequest
from baton.frontend.state import FrontendState
from baton.messages import GenerateDelta, LogprobEntry, PromptLogprobs, Usage
from baton.scheduler_stats import RequestStats

T = TypeVar("T")
IndexedDelta = tuple[int, GenerateDelta]


async def choice_stream(
    state: FrontendState, request_id: str, choice: ChoiceRequest
) -> AsyncIterator[GenerateDelta]:
    """The choice's deltas, observed by the metrics; closing it aborts the request."""
    client = state.require_client()
    tracker = state.metrics.track()
    stream = client.stream(
        choice.prompt,
        choice.params,
        f"{request_id}-{choice.index}",
        choice.priority,
        choice.deadline_ms,
        choice.return_stats,
        choice.chat,
        add_special_tokens=choice.add_special_tokens,
    )
    with state.in_flight.held():  # until the abort that closing the stream sends is out
        try:
            echo = None
            if choice.echo is not None:
                echo = await prompt_echo(client, choice.prompt, choice.echo)  # type: ignore[arg-type]
            async for delta in stream:
                tracker.observe(delta)
                yield delta if echo is None else echo.apply(delta)
        finally:
            await stream.aclose()


async def merged_streams(
    streams: dict[int, AsyncIterator[GenerateDelta]],
) -> AsyncIterator[IndexedDelta]:
    """Deltas of several choices as they come, tagged with the choice index. The first error
    ends the merge; closing it (or an error) closes every choice's stream."""
    if len(streams) == 1:  # the common case needs no tasks
        ((index, stream),) = streams.items()
        try:
            async for delta in stream:
                yield index, delta
        finally:
            await stream.aclose()
        return
    # Bounded: a consumer that falls behind stops the pumps, so the deltas wait in the client's
    # per-request queues, where they make it pause the requests on the server (backpressure).
    queue: asyncio.Queue[tuple[int, GenerateDelta | BaseException | None]] = asyncio.Queue(
        maxsize=len(streams)
    )

    async def pump(index: int, stream: AsyncIterator[GenerateDelta]) -> None:
        try:
            async for delta in stream:
                await queue.put((index, delta))
        except Exception as error:  # handed to the consumer, which re-raises it
            await queue.put((index, error))
            return
        await queue.put((index, None))

    tasks = [asyncio.create_task(pump(index, stream)) for index, stream in streams.items()]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item is None:
                remaining -= 1
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # A pump cancelled inside its stream closed it; one cancelled while it waited for room
        # in the queue (a reader that fell behind) left it open, which only the garbage
        # collector would close: close each, so that every request is aborted now.
        for stream in streams.values():
            await stream.aclose()  # type: ignore[attr-defined]


@dataclass
class ChoiceOutput:
    """A finished choice, accumulated from its deltas."""

    index: int
    group: int
    token_ids: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    logprobs: list[LogprobEntry] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None
    stats: RequestStats | None = None
    prompt_logprobs: PromptLogprobs | None = None  # when the prompt was scored
    in_reasoning: bool = False  # the text opens in the model's reasoning (baton/reasoning.py)

    @property
    def text(self) -> str:
        """The generated text."""
        return "".join(self.texts)


async def collect(choice: ChoiceRequest, stream: AsyncIterator[GenerateDelta]) -> ChoiceOutput:
    """Run one choice to the end."""
    output = ChoiceOutput(choice.index, choice.group)
    async for delta in stream:
        if delta.admission:
            output.in_reasoning = delta.in_reasoning
        output.token_ids.extend(delta.token_ids)
        output.texts.append(delta.text)
        if delta.logprobs:
            output.logprobs.extend(delta.logprobs)
        if delta.prompt_logprobs is not None:
            output.prompt_logprobs = delta.prompt_logprobs
        if delta.finished:
            output.finish_reason = delta.finish_reason
            output.usage = delta.usage
            output.stats = delta.stats
    return output


async def gather_or_cancel(awaitables: list[Awaitable[T]]) -> list[T]:
    """Like gather, but the first error cancels the others (aborting their requests)."""
    tasks = [asyncio.ensure_future(awaitable) for awaitable in awaitables]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (and raising ClientGone) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        raise ClientGone()
    return task.result()


async def _disconnected(request: Request) -> None:
    """Return once the client has gone (the body was read already, so only that can come)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def stats_body(stats: RequestStats | None) -> dict[str, object] | None:
    """A request's stats as JSON (`return_stats`)."""
    return None if stats is None else msgspec.structs.asdict(stats)


class UsageTotals:
    """OpenAI's `usage` over several choices: each prompt's tokens count once."""

    def __init__(self) -> None:
        self._prompt_tokens: dict[int, int] = {}
        self._cached_tokens: dict[int, int] = {}
        self._completion_tokens = 0

    def add(self, group: int, usage: Usage | None) -> None:
        """Account a finished choice of prompt `group`."""
        if usage is None:
            return
        self._prompt_tokens.setdefault(group, usage.prompt_tokens)
        self._cached_tokens.setdefault(group, usage.cached_tokens)
        self._completion_tokens += usage.completion_tokens

    def body(self) -> dict[str, object]:
        """The `usage` object (with vLLM's `prompt_tokens_details.cached_tokens`)."""
        prompt_tokens = sum(self._prompt_tokens.values())
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": self._completion_tokens,
            "total_tokens": prompt_tokens + self._completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(self._cached_tokens.values())},
        }
