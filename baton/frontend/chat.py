"""`POST /v1/chat/completions`: chat completions, streamed or not.

The tokenizer process renders the messages (the model's chat template, or its plain fallback).
"""

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
from baton.frontend.params import ChoiceRequest, chat_choices
from baton.frontend.protocol import ChatCompletionRequest
from baton.frontend.state import frontend_state
from baton.frontend.streaming import ChunkWriterBase, stream_response
from baton.messages import GenerateDelta

router = APIRouter()
ROLE = "assistant"


@router.post("/v1/chat/completions")
async def create_chat_completion(request: Request) -> Response:
    """OpenAI's chat completions endpoint (vLLM's sampling extensions included)."""
    state = frontend_state(request)
    body = ChatCompletionRequest.model_validate_json(await request.body())
    state.check_model(body.model)
    state.require_client()  # 503 before any work if the pipeline is not connected
    choices = chat_choices(body)
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    streams = {choice.index: choice_stream(state, response_id, choice) for choice in choices}
    decoder = state.decoder if body.logprobs else None
    if body.stream:
        envelope = _envelope(response_id, "chat.completion.chunk", created, state.model_name)
        writer = ChatChunkWriter(envelope, choices, body.include_usage, decoder)
        return await stream_response(request, merged_streams(streams), writer)
    runs = [collect(choice, streams[choice.index]) for choice in choices]
    outputs = await unless_disconnected(request, gather_or_cancel(runs))
    envelope = _envelope(response_id, "chat.completion", created, state.model_name)
    return json_response(chat_body(envelope, outputs, decoder))


def _envelope(response_id: str, kind: str, created: int, model: str) -> dict[str, object]:
    return {"id": response_id, "object": kind, "created": created, "model": model}


def chat_body(
    envelope: dict[str, object], outputs: list[ChoiceOutput], decoder: TokenTextDecoder | None
) -> dict[str, object]:
    """A non-streamed response; `decoder` is given when logprobs were asked for."""
    usage = UsageTotals()
    choices = []
    for output in sorted(outputs, key=lambda output: output.index):
        usage.add(output.group, output.usage)
        logprobs = None
        if decoder is not None:
            logprobs = ChoiceLogprobs(decoder).chat(output.token_ids, output.logprobs)
        choices.append(
            {
                "index": output.index,
                "message": {"role": ROLE, "content": output.text},
                "logprobs": logprobs,
                "finish_reason": output.finish_reason,
            }
        )
    return {**envelope, "choices": choices, "usage": usage.body()}


class ChatChunkWriter(ChunkWriterBase):
    """Streamed chat chunks: a role chunk opens each choice, then one chunk per delta."""

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
        self._opened: set[int] = set()

    def chunks(self, index: int, delta: GenerateDelta) -> list[dict]:
        """The chunks for one delta (the role chunk first, for a choice's first delta)."""
        chunks = []
        if index not in self._opened:
            self._opened.add(index)
            opening = {
                "index": index,
                "delta": {"role": ROLE, "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            chunks.append(self._chunk(opening))
        logprobs = None
        if self._logprobs is not None:
            logprobs = self._logprobs[index].chat(delta.token_ids, delta.logprobs)
        elif not (delta.token_ids or delta.finished):
            return chunks
        choice = {
            "index": index,
            "delta": {"content": delta.text} if delta.text else {},
            "logprobs": logprobs,
            "finish_reason": delta.finish_reason if delta.finished else None,
        }
        chunks.append(self._chunk(choice, delta))
        return chunks
