"""vLLM's `POST /tokenize` and `POST /detokenize`: the tokenizer process answers, so a prompt is
tokenized exactly as a generation request's would be (a chat through the model's template)."""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request, Response
from pydantic import field_validator

from baton.client import BatonClient
from baton.frontend.chat_protocol import ChatTemplateRequest
from baton.frontend.errors import OpenAIError, json_response
from baton.frontend.params import chat_messages, chat_options
from baton.frontend.protocol import NullMeansDefault, TokenId
from baton.frontend.state import frontend_state
from baton.messages import TokenizeReply

router = APIRouter()


class TokenizeTextBody(NullMeansDefault):
    """A text to tokenize; `add_special_tokens` adds the tokenizer's BOS and the like."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatBody(ChatTemplateRequest):
    """A conversation to tokenize as chat completions would render it. Whether special tokens
    are added is the template's to say, as for chat completions: vLLM's `add_special_tokens`
    is accepted at its default, false, only."""

    model: str | None = None
    return_token_strs: bool = False
    add_special_tokens: bool = False

    @field_validator("add_special_tokens")
    @classmethod
    def _template_decides(cls, value: bool) -> bool:
        if value:
            raise ValueError("add_special_tokens=true is not supported with messages")
        return value


class DetokenizeBody(NullMeansDefault):
    """Token ids to turn into text (special tokens kept)."""

    model: str | None = None
    tokens: list[TokenId]


@router.post("/tokenize")
async def tokenize(request: Request) -> Response:
    """The prompt's token ids, their count and the context length, as vLLM answers."""
    state = frontend_state(request)
    raw = await request.body()
    body = _tokenize_body(raw)
    state.check_model(body.model)
    client = state.require_client()
    with state.in_flight.held():  # shutdown waits for the round trip, as for a stream
        reply = await _tokenized(client, body)
    return json_response(
        {
            "count": len(reply.token_ids),
            "max_model_len": state.max_model_len,
            "tokens": reply.token_ids,
            "token_strs": reply.token_strs,
        }
    )


@router.post("/detokenize")
async def detokenize(request: Request) -> Response:
    """The text of the token ids, as vLLM answers."""
    state = frontend_state(request)
    body = DetokenizeBody.model_validate_json(await request.body())
    state.check_model(body.model)
    client = state.require_client()
    with state.in_flight.held():
        text = await client.detokenize(body.tokens)
    return json_response({"prompt": text})


async def _tokenized(
    client: BatonClient, body: TokenizeTextBody | TokenizeChatBody
) -> TokenizeReply:
    strs = body.return_token_strs
    if isinstance(body, TokenizeChatBody):
        options = chat_options(body)
        return await client.tokenize(chat_messages(body), chat=options, return_token_strs=strs)
    special = body.add_special_tokens
    return await client.tokenize(body.prompt, add_special_tokens=special, return_token_strs=strs)


def _tokenize_body(raw: bytes) -> TokenizeTextBody | TokenizeChatBody:
    """A chat request if the body has `messages`, else a completion one (vLLM's union); a 400
    for both, which the ZMQ protocol refuses too, rather than one of them silently dropped."""
    try:
        fields: Any = json.loads(raw)
    except (ValueError, RecursionError):  # nesting past Python's stack, too
        fields = None  # the model's own parse reports it, as for every other route
    if isinstance(fields, dict) and fields.get("messages") is not None:
        if fields.get("prompt") is not None:
            raise OpenAIError(400, "exactly one of prompt and messages must be set (got both)")
        return TokenizeChatBody.model_validate_json(raw)
    return TokenizeTextBody.model_validate_json(raw)
