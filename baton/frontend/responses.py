"""`POST /v1/responses`: OpenAI's Responses API, stateless, as vLLM serves it.

A request becomes a chat completion request (frontend/responses_protocol.py), so validation,
sampling defaults, the chat template, structured outputs, tool calls and reasoning are the
chat endpoint's; only the response is laid out differently: output items
(frontend/responses_output.py), streamed as typed events (frontend/responses_stream.py).
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Request, Response
from starlette.concurrency import run_in_threadpool

from baton.frontend.choices_response import respond_with_choices
from baton.frontend.generation import ChoiceOutput
from baton.frontend.logprobs import ChoiceLogprobs
from baton.frontend.params import chat_choices, tool_plan
from baton.frontend.responses_output import FunctionCall, ReplyOutput, ResponseShell, new_id
from baton.frontend.responses_protocol import ResponsesRequest, in_responses_terms
from baton.frontend.responses_stream import ResponseEventWriter
from baton.frontend.state import frontend_state
from baton.frontend.tools import ToolPlan
from baton.reasoning import split_reasoning

router = APIRouter()


@router.post("/v1/responses")
async def create_response(request: Request) -> Response:
    """OpenAI's Responses endpoint: one reply to the conversation `input` holds."""
    state = frontend_state(request)
    body = ResponsesRequest.model_validate_json(await request.body())
    state.check_model(body.model)
    state.require_client()  # 503 before any work if the pipeline is not connected
    with in_responses_terms():
        chat = body.chat_request()
        plan = tool_plan(chat, state.tool_call_parser)
        if chat.constrained or plan.mode in ("required", "named"):  # a grammar: off the loop
            choices = await run_in_threadpool(chat_choices, chat, state.sampling_defaults, plan)
        else:
            choices = chat_choices(chat, state.sampling_defaults, plan)
    params = choices[0].params
    shell = ResponseShell(
        new_id("resp"),
        int(time.time()),
        state.model_name,
        body.settings(params.temperature, params.top_p),
    )
    splits_reasoning = state.reasoning_parser is not None
    as_token_ids = state.tokens_as_ids(chat.return_tokens_as_token_ids)

    def logprobs() -> ChoiceLogprobs | None:
        return ChoiceLogprobs(as_token_ids) if body.with_logprobs else None

    return await respond_with_choices(
        request,
        state,
        shell.response_id,
        choices,
        body.stream,
        lambda: ResponseEventWriter(shell, plan, splits_reasoning, logprobs()),
        lambda outputs: response_body(shell, outputs[0], plan, splits_reasoning, logprobs()),
    )


def response_body(
    shell: ResponseShell,
    output: ChoiceOutput,
    plan: ToolPlan,
    splits_reasoning: bool,
    logprobs: ChoiceLogprobs | None,
) -> dict[str, object]:
    """A non-streamed response: the reply's reasoning split off (under --reasoning-parser), its
    tool calls read by `plan`, and its tokens' `logprobs` when asked for."""
    reasoning, text = split_reasoning(output.text, output.in_reasoning and splits_reasoning)
    content, calls = plan.read(text) if text is not None else (None, [])
    reply = ReplyOutput(
        reasoning=reasoning or "",
        content=content or "",
        logprobs=None if logprobs is None else logprobs.chat(output.logprobs)["content"],
        calls=[FunctionCall.of(call) for call in calls],
    )
    return shell.finished(reply, output.finish_reason, output.usage)
