"""A streamed reply split into reasoning, content and tool calls as its deltas come."""

from __future__ import annotations

from baton.frontend.streamed_reply import StreamedReply
from baton.frontend.tools import NO_TOOLS, ToolPlan


def test_reasoning_then_content_then_a_call() -> None:
    reply = StreamedReply(ToolPlan("auto", parser="hermes"))
    reply.opens_in_reasoning()
    pieces = ["Let me ", "think.</think>", "Sure. <tool", '_call>{"name": "get_time"}']
    fed = [reply.feed(piece, finished=False) for piece in pieces]
    assert [thought for thought, _, _ in fed] == ["Let me ", "think.", "", ""]
    assert "".join(content for _, content, _ in fed) == "Sure."
    thought, content, calls = reply.feed("</tool_call>", finished=True)
    assert (thought, content) == ("", "")
    assert [call["function"]["name"] for call in calls] == ["get_time"]


def test_a_plain_reply_is_all_content() -> None:
    reply = StreamedReply(NO_TOOLS)
    assert reply.feed("Hi </think> there", finished=False) == ("", "Hi </think> there", [])
    assert reply.feed("", finished=True) == ("", "", [])
