"""`POST /v1/chat/completions`: chat completions, streamed or not.

The tokenizer process renders the messages (the model's chat template, or its plain fallback).
With vLLM's `echo`, each reply's content starts with the final message's content when that
message has the reply's role (`ChatCompletionRequest.echoed`): in a streamed reply, as the
first content delta after the role chunk. Under --reasoning-parser, a reply that opens in the
model's reasoning (the admission delta says) is split into `reasoning` and content
(baton/reasoning.py); `include_reasoning: false` drops the reasoning. A reply's tool calls
(frontend/tools.py) are read from its content once complete: a streamed reply sends them in its
final chunk, and holds back from its content what may open one.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from fastapi import APIRouter, Request, Response
from starlette.concurrency import run_in_threadpool

from baton.frontend.chat_protocol import ChatCompletionRequest
from baton.frontend.choices_response import respond_with_choices, response_body, response_envelope
from baton.frontend.generation import ChoiceOutput
from baton.frontend.logprobs import ChoiceLogprobs, vllm_prompt_logprobs
from baton.frontend.params import ChoiceRequest, chat_choices, tool_plan
from baton.frontend.state import frontend_state
from baton.frontend.streamed_reply import StreamedReply
from baton.frontend.streaming import ChunkWriterBase
from baton.frontend.tools import NO_TOOLS, ToolPlan
from baton.messages import GenerateDelta
from baton.reasoning import split_reasoning

router = APIRouter()

# What a server and request do with a reply's reasoning: "off" without --reasoning-parser (no
# `reasoning` field: the text is all content), else split it off and return it or drop it.
ReasoningMode = Literal["off", "returned", "dropped"]


@router.post("/v1/chat/completions")
async def create_chat_completion(request: Request) -> Response:
    """OpenAI's chat completions endpoint (vLLM's sampling and chat template extensions)."""
    state = frontend_state(request)
    body = ChatCompletionRequest.model_validate_json(await request.body())
    state.check_model(body.model)
    state.require_client()  # 503 before any work if the pipeline is not connected
    plan = tool_plan(body, state.tool_call_parser)
    if body.constrained or plan.mode in ("required", "named"):
        choices = await run_in_threadpool(chat_choices, body, state.sampling_defaults, plan)
    else:
        choices = chat_choices(body, state.sampling_defaults, plan)
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    with_logprobs = bool(body.logprobs)
    as_token_ids = state.tokens_as_ids(body.return_tokens_as_token_ids)
    role, echoed = body.reply_role, body.echoed
    reasoning: ReasoningMode = "off"
    if state.reasoning_parser is not None:
        reasoning = "returned" if body.include_reasoning else "dropped"
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
            chunk_envelope,
            choices,
            body.include_usage,
            with_logprobs,
            body.return_stats,
            role,
            echoed,
            as_token_ids=as_token_ids,
            plan=plan,
            reasoning=reasoning,
        ),
        lambda outputs: chat_body(
            body_envelope,
            outputs,
            with_logprobs,
            body.return_stats,
            role,
            echoed,
            as_token_ids=as_token_ids,
            plan=plan,
            reasoning=reasoning,
        ),
    )


def chat_body(
    envelope: dict[str, object],
    outputs: list[ChoiceOutput],
    with_logprobs: bool,
    with_stats: bool,
    role: str,
    echoed: str,
    *,
    as_token_ids: bool = False,
    plan: ToolPlan = NO_TOOLS,
    reasoning: ReasoningMode = "off",
) -> dict[str, object]:
    """A non-streamed response: each message has `role` and its content starts with `echoed`;
    its reasoning is split off as `reasoning` says; its tool calls are read from its content by
    `plan`; `with_logprobs` and `with_stats` when those were asked for."""

    def choice_body(output: ChoiceOutput) -> dict[str, object]:
        logprobs = ChoiceLogprobs(as_token_ids).chat(output.logprobs) if with_logprobs else None
        thought, text = split_reasoning(output.text, output.in_reasoning and reasoning != "off")
        content, calls = plan.read(text) if text is not None else (None, [])
        message: dict[str, object] = {
            "role": role,
            "content": echoed + content if content is not None else echoed or None,
        }
        if reasoning != "off":
            message["reasoning"] = thought if reasoning == "returned" else None
        if calls:
            message["tool_calls"] = calls
        return {
            "index": output.index,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": _finish_reason(plan, calls, output.finish_reason),
        }

    body = response_body(envelope, outputs, choice_body, with_stats)
    scored = [output.prompt_logprobs for output in outputs if output.prompt_logprobs is not None]
    if scored:  # vLLM's: the conversation's, once for all its choices
        body["prompt_logprobs"] = vllm_prompt_logprobs(scored[0])
    return body


def _finish_reason(plan: ToolPlan, calls: list, finish_reason: str | None) -> str | None:
    """OpenAI's: "tool_calls" when the model chose to call, but a named (forced) call ends as
    the generation did."""
    return "tool_calls" if calls and plan.mode != "named" else finish_reason


class ChatChunkWriter(ChunkWriterBase):
    """Streamed chat chunks: a role chunk opens each choice (then the echoed content, if any),
    then one chunk per delta."""

    def __init__(
        self,
        envelope: dict[str, object],
        choices: list[ChoiceRequest],
        include_usage: bool,
        with_logprobs: bool,
        with_stats: bool,
        role: str,
        echoed: str,
        *,
        as_token_ids: bool = False,
        plan: ToolPlan = NO_TOOLS,
        reasoning: ReasoningMode = "off",
    ) -> None:
        super().__init__(
            envelope, choices, include_usage, with_logprobs, with_stats, as_token_ids=as_token_ids
        )
        self._role = role
        self._echoed = echoed
        self._plan = plan
        self._replies = {choice.index: StreamedReply(plan) for choice in choices}
        self._reasoning = reasoning

    def chunks(self, index: int, delta: GenerateDelta) -> list[dict]:
        """The chunks for one delta (the opening chunks first, for a choice's first delta)."""
        if delta.admission:  # the headers go out now; the opening chunk, as vLLM's, with output
            if delta.in_reasoning and self._reasoning != "off":
                self._replies[index].opens_in_reasoning()
            return []
        chunks = []
        if index not in self._opened:
            self._opened.add(index)
            chunks.append(self._chunk(self._choice(index, {"role": self._role, "content": ""})))
            if self._echoed:
                chunks.append(self._chunk(self._choice(index, {"content": self._echoed})))
        logprobs = None
        if self._logprobs is not None:
            logprobs = self._logprobs[index].chat(delta.logprobs)
        elif not (delta.token_ids or delta.finished):
            return chunks
        thought, content, calls = self._replies[index].feed(delta.text, delta.finished)
        fields: dict[str, object] = {"content": content} if content else {}
        if thought and self._reasoning == "returned":
            fields = {"reasoning": thought, **fields}
        if calls:
            fields["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
        if not fields and logprobs is None and not delta.finished:
            return chunks  # text held back by the tool parser: nothing to say yet
        choice = self._choice(index, fields, logprobs)
        if delta.finished:
            choice["finish_reason"] = _finish_reason(self._plan, calls, delta.finish_reason)
        chunks.append(self._chunk(choice, delta))
        return chunks

    @staticmethod
    def _choice(
        index: int, delta: dict[str, object], logprobs: dict | None = None
    ) -> dict[str, object]:
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": None}
