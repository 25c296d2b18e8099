"""`POST /v1/completions`: text completions, streamed or not."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request, Response

from baton.frontend.errors import json_response
from baton.frontend.generation import (
    ChoiceOutput,
    UsageTotals,
    choice_stream,
    collect,
    gather_or_cancel,
    merged_streams,
    unless_disconnected,
)
from baton.frontend.logprobs import ChoiceLogprobs, TokenTextDecoder
from baton.frontend.params import ChoiceRequest, completion_choices
from baton.frontend.protocol import CompletionRequest
from baton.frontend.state import frontend_state
from baton.frontend.streaming import ChunkWriterBase, stream_response
from baton.messages import GenerateDelta

router = APIRouter()
OBJECT = "text_completion"


@router.post("/v1/completions")
async def create_completion(request: Request) -> Response:
    """OpenAI's completions endpoint (vLLM's sampling extensions included)."""
    state = frontend_state(request)
    body = CompletionRequest.model_validate_json(await request.body())
    state.check_model(body.model)
    state.require_client()  # 503 before any work if the pipeline is not connected
    choices = completion_choices(body)
    response_id = f"cmpl-{uuid.uuid4().hex}"
    envelope = {
        "id": response_id,
        "object": OBJECT,
        "created": int(time.time()),
        "model": state.model_name,
    }
    streams = {choice.index: choice_stream(state, response_id, choice) for choice in choices}
    with_logprobs = body.logprobs is not None
    if body.stream:
        writer = CompletionChunkWriter(
            envelope, choices, body.include_usage, state.decoder if with_logprobs else None
        )
        return await stream_response(request, merged_streams(streams), writer)
    runs = [collect(choice, streams[choice.index]) for choice in choices]
    outputs = await unless_disconnected(request, gather_or_cancel(runs))
    decoder = state.decoder if with_logprobs else None
    return json_response(completion_body(envelope, outputs, decoder))


def completion_body(
    envelope: dict[str, object], outputs: list[ChoiceOutput], decoder: TokenTextDecoder | None
) -> dict[str, object]:
    """A non-streamed response; `decoder` is given when logprobs were asked for."""
    usage = UsageTotals()
    choices = []
    for output in sorted(outputs, key=lambda output: output.index):
        usage.add(output.group, output.usage)
        logprobs = None
        if decoder is not None:
            logprobs = ChoiceLogprobs(decoder).completion(output.token_ids, output.logprobs)
        choices.append(
            {
                "index": output.index,
                "text": output.text,
                "logprobs": logprobs,
                "finish_reason": output.finish_reason,
            }
        )
    return {**envelope, "choices": choices, "usage": usage.body()}


class CompletionChunkWriter(ChunkWriterBase):
    """Streamed completion chunks: one per delta, logprobs with running text offsets."""

    def __init__(
        self,
        envelope: dict[str, object],
        choices: list[ChoiceRequest],
        include_usage: bool,
        decoder: TokenTextDecoder | None,
    ) -> None:
        super().__init__(envelope, choices, include_usage)
        self._logprobs = (
            {choice.index: ChoiceLogprobs(decoder) for choice in choices} if decoder else None
        )

    def chunks(self, index: int, delta: GenerateDelta) -> list[dict]:
        """The chunk for one delta (as vLLM: one per delta with new tokens, even if its text is
        held back); none for a delta without tokens."""
        logprobs = None
        if self._logprobs is not None:
            logprobs = self._logprobs[index].completion(delta.token_ids, delta.logprobs)
        elif not (delta.token_ids or delta.finished):
            return []
        choice = {
            "index": index,
            "text": delta.text,
            "logprobs": logprobs,
            "finish_reason": delta.finish_reason if delta.finished else None,
        }
        return [self._chunk(choice, delta)]
