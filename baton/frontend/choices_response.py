"""What the completions, chat and responses endpoints share: run every choice, then stream or
answer once."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import Request, Response

from baton.frontend.errors import json_response
from baton.frontend.generation import (
    ChoiceOutput,
    UsageTotals,
    choice_stream,
    collect,
    gather_or_cancel,
    merged_streams,
    stats_body,
    unless_disconnected,
)
from baton.frontend.params import ChoiceRequest
from baton.frontend.state import FrontendState
from baton.frontend.streaming import ChunkWriter, stream_response


def response_envelope(response_id: str, kind: str, created: int, model: str) -> dict[str, object]:
    """The fields every response body and chunk opens with (`kind` is OpenAI's `object`)."""
    return {"id": response_id, "object": kind, "created": created, "model": model}


async def respond_with_choices(
    request: Request,
    state: FrontendState,
    response_id: str,
    choices: list[ChoiceRequest],
    stream: bool,
    writer: Callable[[], ChunkWriter],
    body: Callable[[list[ChoiceOutput]], dict[str, object]],
) -> Response:
    """Start every choice's pipeline request; stream the chunks `writer()` makes, or wait for
    every choice and answer with `body(outputs)`."""
    streams = {choice.index: choice_stream(state, response_id, choice) for choice in choices}
    if stream:
        return await stream_response(request, merged_streams(streams), writer(), len(choices))
    runs = [collect(choice, streams[choice.index]) for choice in choices]
    outputs = await unless_disconnected(request, gather_or_cancel(runs))
    return json_response(body(outputs))


def response_body(
    envelope: dict[str, object],
    outputs: list[ChoiceOutput],
    choice_body: Callable[[ChoiceOutput], dict[str, object]],
    with_stats: bool,
) -> dict[str, object]:
    """A non-streamed response: `envelope`, one `choice_body` per choice in index order (with
    its request's stats when asked), and the usage of them all."""
    usage = UsageTotals()
    choices = []
    for output in sorted(outputs, key=lambda output: output.index):
        usage.add(output.group, output.usage)
        choices.append(choice_body(output))
        if with_stats:
            choices[-1]["stats"] = stats_body(output.stats)
    return {**envelope, "choices": choices, "usage": usage.body()}
