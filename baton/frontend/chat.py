"""`POST /v1/chat/completions`: chat completions, streamed or not.

The tokenizer process renders the messages (the model's chat template, or its plain fallback).
"""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request, Response

from baton.frontend.choices_response import respond_with_choices, response_body, response_envelope
from baton.frontend.generation import ChoiceOutput
from baton.frontend.logprobs import ChoiceLogprobs
from baton.frontend.params import chat_choices
from baton.frontend.protocol import ChatCompletionRequest
from baton.frontend.state import frontend_state
from baton.frontend.streaming import ChunkWriterBase
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
    with_logprobs = bool(body.logprobs)
    chunk_envelope = response_envelope(
        response_id, "chat.completion.chunk", created, state.model_name
    )
    body_envelope = response_envelope(response_id, "chat.completion", created, state.model_name)
    return await respond_with_choices(
        request,
        state,
        response_id,
        choices,
        body.stream,
        lambda: ChatChunkWriter(
            chunk_envelope, choices, body.include_usage, with_logprobs, body.return_stats
        ),
        lambda outputs: chat_body(body_envelope, outputs, with_logprobs, body.return_stats),
    )


def chat_body(
    envelope: dict[str, object],
    outputs: list[ChoiceOutput],
    with_logprobs: bool,
    with_stats: bool,
) -> dict[str, object]:
    """A non-streamed response; `with_logprobs` and `with_stats` when those were asked for."""

    def choice_body(output: ChoiceOutput) -> dict[str, object]:
        logprobs = ChoiceLogprobs().chat(output.logprobs) if with_logprobs else None
        return {
            "index": output.index,
            "message": {"role": ROLE, "content": output.text},
            "logprobs": logprobs,
            "finish_reason": output.finish_reason,
        }

    return response_body(envelope, outputs, choice_body, with_stats)


class ChatChunkWriter(ChunkWriterBase):
    """Streamed chat chunks: a role chunk opens each choice, then one chunk per delta."""

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
            logprobs = self._logprobs[index].chat(delta.logprobs)
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
