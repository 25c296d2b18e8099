"""A Responses API response object and its output items, built alike whether streamed or not.

A reply becomes, in order: a reasoning item (under --reasoning-parser, when it reasoned), a
message with its text (when it has text, or when it has nothing else), and one function call
item per tool call. When the response is incomplete (its output cut by `max_output_tokens`),
its last item is; the others are complete.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from baton.messages import Usage

ItemStatus = Literal["in_progress", "completed", "incomplete"]
ResponseStatus = Literal["in_progress", "completed", "incomplete", "failed"]
# What a failed generation (a constraint that broke mid-output) reports.
GENERATION_FAILED = {"code": "server_error", "message": "the generation failed"}


def new_id(prefix: str) -> str:
    """A fresh id of OpenAI's shape: `resp_...`, `msg_...`, `fc_...`."""
    return f"{prefix}_{uuid.uuid4().hex}"


def output_text(text: str, logprobs: list[dict] | None) -> dict[str, object]:
    """A message's text part (`logprobs`: its tokens', when asked for)."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def reasoning_text(text: str) -> dict[str, object]:
    """A reasoning item's text part."""
    return {"type": "reasoning_text", "text": text}


def reasoning_item(item_id: str, parts: list[dict], status: ItemStatus) -> dict[str, object]:
    """A reasoning item; never a summary (Baton writes none)."""
    return {"type": "reasoning", "id": item_id, "summary": [], "content": parts, "status": status}


def message_item(item_id: str, parts: list[dict], status: ItemStatus) -> dict[str, object]:
    """An assistant message item."""
    return {
        "type": "message",
        "id": item_id,
        "role": "assistant",
        "status": status,
        "content": parts,
    }


@dataclass(frozen=True)
class FunctionCall:
    """One tool call of a reply, with its item's id and the id its output will answer."""

    name: str
    arguments: str
    item_id: str = field(default_factory=lambda: new_id("fc"))
    call_id: str = field(default_factory=lambda: new_id("call"))

    @classmethod
    def of(cls, call: dict[str, Any]) -> FunctionCall:
        """From the chat path's call (ToolPlan.read)."""
        return cls(call["function"]["name"], call["function"]["arguments"])

    def item(self, arguments: str, status: ItemStatus) -> dict[str, object]:
        """Its item, with `arguments` so far."""
        return {
            "type": "function_call",
            "id": self.item_id,
            "call_id": self.call_id,
            "name": self.name,
            "arguments": arguments,
            "status": status,
        }


@dataclass
class ReplyOutput:
    """A reply's parts, each with the id of the item it becomes (a stream names them early)."""

    reasoning: str = ""
    content: str = ""
    logprobs: list[dict] | None = None  # the text's tokens', when asked for
    calls: list[FunctionCall] = field(default_factory=list)
    reasoning_id: str = field(default_factory=lambda: new_id("rs"))
    message_id: str = field(default_factory=lambda: new_id("msg"))

    def items(self, last_status: ItemStatus) -> list[dict[str, object]]:
        """The output items, the last with `last_status`."""
        items = []
        if self.reasoning:
            items.append(
                reasoning_item(self.reasoning_id, [reasoning_text(self.reasoning)], "completed")
            )
        if self.content or not (items or self.calls):
            text = output_text(self.content, self.logprobs)
            items.append(message_item(self.message_id, [text], "completed"))
        items += [call.item(call.arguments, "completed") for call in self.calls]
        items[-1]["status"] = last_status
        return items


def finish_status(finish_reason: str | None) -> ResponseStatus:
    """The response's status once its generation ended so."""
    if finish_reason == "length":
        return "incomplete"
    return "failed" if finish_reason == "error" else "completed"


def usage_body(usage: Usage | None) -> dict[str, object] | None:
    """OpenAI's Responses `usage` (reasoning tokens are not counted apart)."""
    if usage is None:
        return None
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


@dataclass(frozen=True)
class ResponseShell:
    """What every state of one response carries: its id, creation time, model, and the
    request's settings it echoes."""

    response_id: str
    created_at: int
    model: str
    settings: dict[str, object]

    def body(
        self,
        status: ResponseStatus,
        output: list[dict[str, object]],
        usage: Usage | None = None,
    ) -> dict[str, object]:
        """The response object."""
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "model": self.model,
            "status": status,
            "error": GENERATION_FAILED if status == "failed" else None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "output": output,
            "usage": usage_body(usage),
            **self.settings,
        }

    def finished(
        self, reply: ReplyOutput, finish_reason: str | None, usage: Usage | None
    ) -> dict[str, object]:
        """The response object of a finished reply."""
        status = finish_status(finish_reason)
        return self.body(status, reply.items(last_item_status(status)), usage)


def last_item_status(status: ResponseStatus) -> ItemStatus:
    """The status of a response's last item: the others are complete."""
    return "completed" if status == "completed" else "incomplete"
