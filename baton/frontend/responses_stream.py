"""A streamed Responses API response: OpenAI's typed events, `event: <type>` and `data: {json}`,
each with its `sequence_number`, and no `[DONE]` line.

response.created and response.in_progress open the stream (on the pipeline's admission); each
output item then opens (response.output_item.added, and its text part's
response.content_part.added), streams its text (response.reasoning_text.delta, then
response.output_text.delta), and closes with the matching .done events. Tool calls are read
once the reply is complete (frontend/tools.py), so each function call item comes whole at the
end, its arguments in one response.function_call_arguments.delta. response.completed (or
response.incomplete, or response.failed) carries the whole response, as a non-streamed request
gets it. An error once the stream has started is an `error` event.
"""

from __future__ import annotations

import msgspec

from baton.frontend.errors import OpenAIError
from baton.frontend.logprobs import ChoiceLogprobs
from baton.frontend.responses_output import (
    FunctionCall,
    ReplyOutput,
    ResponseShell,
    finish_status,
    last_item_status,
    message_item,
    output_text,
    reasoning_item,
    reasoning_text,
)
from baton.frontend.streamed_reply import StreamedReply
from baton.frontend.tools import ToolPlan
from baton.messages import GenerateDelta

_encode = msgspec.json.Encoder().encode


class ResponseEventWriter:
    """The events of one streamed response (its one choice): a `ChunkWriter` for
    streaming.stream_response."""

    stream_end = b""  # OpenAI's Responses stream has no [DONE]

    def __init__(
        self,
        shell: ResponseShell,
        plan: ToolPlan,
        splits_reasoning: bool,
        logprobs: ChoiceLogprobs | None,
    ) -> None:
        self._shell = shell
        self._splits_reasoning = splits_reasoning
        self._reply_text = StreamedReply(plan)
        self._logprobs = logprobs
        self._unsent_logprobs: list[dict] = []
        self._reply = ReplyOutput(
            reasoning="", content="", logprobs=[] if logprobs is not None else None
        )
        self._open: str | None = None  # the type of the item being written
        self._output_index = -1  # that item's index in the output
        self._sequence = 0

    def chunks(self, index: int, delta: GenerateDelta) -> list[dict]:
        """The events one delta makes."""
        if delta.admission:
            if delta.in_reasoning and self._splits_reasoning:
                self._reply_text.opens_in_reasoning()
            opening = self._shell.body("in_progress", [])
            return [
                self._event("response.created", response=opening),
                self._event("response.in_progress", response=opening),
            ]
        all_logprobs = self._reply.logprobs
        if self._logprobs is not None and all_logprobs is not None and delta.logprobs:
            entries = self._logprobs.chat(delta.logprobs)["content"]
            all_logprobs += entries
            self._unsent_logprobs += entries
        thought, content, calls = self._reply_text.feed(delta.text, delta.finished)
        events = self._reasoning_delta(thought) if thought else []
        if content:
            events += self._text_delta(content)
        if delta.finished:
            events += self._finish(delta, calls)
        return events

    def final_chunks(self) -> list[dict]:
        """Nothing: the finished delta's events end the stream."""
        return []

    def encode(self, chunks: list[dict]) -> bytes:
        """Each event under its type's name."""
        return b"".join(
            b"event: " + chunk["type"].encode() + b"\ndata: " + _encode(chunk) + b"\n\n"
            for chunk in chunks
        )

    def error_chunks(self, error: OpenAIError) -> list[dict]:
        """OpenAI's `error` event."""
        return [self._event("error", code=error.code, message=error.message, param=error.param)]

    def _event(self, kind: str, **fields: object) -> dict:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def _located(self, kind: str, **fields: object) -> dict:
        """An event about the open item's text part."""
        item_id = self._reply.reasoning_id if self._open == "reasoning" else self._reply.message_id
        location = {"item_id": item_id, "output_index": self._output_index, "content_index": 0}
        return self._event(kind, **location, **fields)

    def _opened(self, item: dict, part: dict) -> list[dict]:
        """The events opening the next item, of `item`'s type, and its text part."""
        self._output_index += 1
        self._open = str(item["type"])
        return [
            self._event("response.output_item.added", output_index=self._output_index, item=item),
            self._located("response.content_part.added", part=part),
        ]

    def _reasoning_delta(self, text: str) -> list[dict]:
        events = []
        if self._open != "reasoning":
            in_progress = reasoning_item(self._reply.reasoning_id, [], "in_progress")
            events += self._opened(in_progress, reasoning_text(""))
        self._reply.reasoning += text
        return [*events, self._located("response.reasoning_text.delta", delta=text)]

    def _text_delta(self, text: str) -> list[dict]:
        events = []
        if self._open != "message":
            events += self._closed(None)  # the reasoning, which the text ends
            in_progress = message_item(self._reply.message_id, [], "in_progress")
            events += self._opened(in_progress, output_text("", []))
        self._reply.content += text
        logprobs, self._unsent_logprobs = self._unsent_logprobs, []
        return [*events, self._located("response.output_text.delta", delta=text, logprobs=logprobs)]

    def _closed(self, item: dict | None) -> list[dict]:
        """The events closing the open item, if any: `item` is its final state (None: an item
        that ended before the reply, complete)."""
        if self._open is None:
            return []
        if self._open == "reasoning":
            part = reasoning_text(self._reply.reasoning)
            item = item or reasoning_item(self._reply.reasoning_id, [part], "completed")
            events = [self._located("response.reasoning_text.done", text=part["text"])]
        else:
            (part,) = item["content"]  # type: ignore[index, misc]
            events = [self._located("response.output_text.done", **_text_done(part))]
        events += [
            self._located("response.content_part.done", part=part),
            self._event("response.output_item.done", output_index=self._output_index, item=item),
        ]
        self._open = None
        return events

    def _finish(self, delta: GenerateDelta, calls: list[dict]) -> list[dict]:
        """The events closing the reply: its open item, the items that come whole (an empty
        message, the function calls), then the whole response."""
        self._reply.calls = [FunctionCall.of(call) for call in calls]
        status = finish_status(delta.finish_reason)
        items = self._reply.items(last_item_status(status))
        events = []
        if self._unsent_logprobs and self._open == "message":
            events += self._text_delta("")
        if self._open is not None:
            events += self._closed(items[self._output_index])
        for item in items[self._output_index + 1 :]:
            events += self._whole(item)
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}
        response = self._shell.body(status, items, delta.usage)
        return [*events, self._event(kind.get(status, "response.failed"), response=response)]

    def _whole(self, item: dict) -> list[dict]:
        """The events of an item that comes whole: a message with no text, or a call."""
        if item["type"] == "message":
            empty = message_item(str(item["id"]), [], "in_progress")
            return [*self._opened(empty, output_text("", [])), *self._closed(item)]
        self._output_index += 1
        located = {"item_id": item["id"], "output_index": self._output_index}
        arguments = item["arguments"]
        return [
            self._event(
                "response.output_item.added",
                output_index=self._output_index,
                item={**item, "arguments": "", "status": "in_progress"},
            ),
            self._event("response.function_call_arguments.delta", **located, delta=arguments),
            self._event("response.function_call_arguments.done", **located, arguments=arguments),
            self._event("response.output_item.done", output_index=self._output_index, item=item),
        ]


def _text_done(part: dict) -> dict[str, object]:
    return {"text": part["text"], "logprobs": part["logprobs"]}
