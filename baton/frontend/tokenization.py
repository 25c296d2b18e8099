"""vLLM's `POST /tokenize` and `POST /detokenize`: the tokenizer process answers, so a prompt is
tokenized exactly as a generation request's would be (a chat through the model's template)."""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request, Response

from baton.frontend.errors import json_response
from baton.frontend.params import chat_messages, chat_options
from baton.frontend.protocol import ChatTemplateRequest, StrictModel, TokenId
from baton.frontend.state import frontend_state

router = APIRouter()


class TokenizeCompletionRequest(StrictModel):
    """A text to tokenize; `add_special_tokens` adds the tokenizer's BOS and the like."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(ChatTemplateRequest):
    """A conversation to tokenize as chat completions would render it."""

    model: str | None = None
    return_token_strs: bool = False


class DetokenizeRequest(StrictModel):
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
    strs = body.return_token_strs
    if isinstance(body, TokenizeChatRequest):
        options = chat_options(body)
        reply = await client.tokenize(chat_messages(body), chat=options, return_token_strs=strs)
    else:
        special = body.add_special_tokens
        reply = await client.tokenize(
            body.prompt, add_special_tokens=special, return_token_strs=strs
        )
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
    body = DetokenizeRequest.model_validate_json(await request.body())
    state.check_model(body.model)
    text = await state.require_client().detokenize(body.tokens)
    return json_response({"prompt": text})


def _tokenize_body(raw: bytes) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """A chat request if the body has `messages`, else a completion one (vLLM's union)."""
    try:
        fields: Any = json.loads(raw)
    except ValueError:
        fields = None  # the model's own parse reports it, as for every other route
    if isinstance(fields, dict) and "messages" in fields:
        return TokenizeChatRequest.model_validate_json(raw)
    return TokenizeCompletionRequest.model_validate_json(raw)
