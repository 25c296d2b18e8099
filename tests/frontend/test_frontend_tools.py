"""Tool calling without a pipeline: which tool_choice a request and server can honour (vLLM's
checks), the constraint a forced call follows, how a reply's calls are read back (the hermes
parser too), and a streamed reply's content held back where a call may open."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from baton.frontend.chat_protocol import ChatCompletionRequest
from baton.frontend.errors import OpenAIError, from_validation_error
from baton.frontend.params import chat_choices, chat_messages, tool_plan
from baton.frontend.tools import AUTO_NEEDS_FLAGS, NamedToolChoice, ToolCallStream, ToolPlan
from baton.messages import ChatMessage

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}


def request(**fields: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "Hi"}], **fields}
    )


def plan(tool_choice: object = None, parser: str | None = None) -> ToolPlan:
    fields = {"tools": [WEATHER, TIME]}
    if tool_choice is not None:
        fields["tool_choice"] = tool_choice
    return tool_plan(request(**fields), parser)


@pytest.mark.parametrize(
    ("fields", "parser", "message"),
    [
        ({"tool_choice": "auto"}, None, "When using `tool_choice`, `tools` must be set."),
        ({"tool_choice": "required"}, None, "`tools` must be set"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, None, "must be set"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "f"}}},
            None,
            "Tool 'f' has not been passed in `tools`.",
        ),
        ({"tools": [WEATHER]}, None, AUTO_NEEDS_FLAGS),  # "auto" is the default with tools
        ({"tools": [WEATHER], "tool_choice": "auto"}, None, AUTO_NEEDS_FLAGS),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "hermes",
            "cannot take response_format or structured_outputs",
        ),
        (
            {"tools": [WEATHER], "tool_choice": "required", "structured_outputs": {"regex": "a"}},
            "hermes",
            "cannot take",
        ),
    ],
)
def test_tool_choices_that_cannot_be_honoured_are_400(
    fields: dict, parser: str | None, message: str
) -> None:
    with pytest.raises(OpenAIError) as refused:
        tool_plan(request(**fields), parser)
    assert (refused.value.status, refused.value.param) == (400, "tool_choice")
    assert message in refused.value.message


def test_tool_names_must_be_unique() -> None:
    with pytest.raises(ValidationError) as raised:
        request(tools=[WEATHER, WEATHER], tool_choice="required")
    error = from_validation_error(raised.value)
    assert (error.status, error.param) == (400, "tools")
    assert "'get_weather' is given twice" in error.message


def test_a_forced_calls_bad_schema_names_the_tools() -> None:
    broken = {"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}
    body = request(tools=[broken], tool_choice="required")
    with pytest.raises(OpenAIError) as refused:
        chat_choices(body, plan=tool_plan(body, None))
    assert (refused.value.status, refused.value.param) == (400, "tools")


def test_auto_keeps_special_tokens_for_the_parser() -> None:
    """A model may write its call tags as special tokens (vLLM's hermes parser keeps them)."""
    body = request(tools=[WEATHER])
    (auto,) = chat_choices(body, plan=tool_plan(body, "hermes"))
    assert auto.params.skip_special_tokens is False
    body = request(tools=[WEATHER], tool_choice="none")
    (none,) = chat_choices(body, plan=tool_plan(body, "hermes"))
    assert none.params.skip_special_tokens is True


def test_plans_and_their_constraints() -> None:
    assert tool_plan(request(), None).mode == "none"
    assert tool_plan(request(tool_choice="none"), None).mode == "none"
    assert plan("none").mode == "none"  # tools offered, never read as calls
    auto = plan(parser="hermes")  # "auto" is the default with tools
    assert (auto.mode, auto.parser, len(auto.tools)) == ("auto", "hermes", 2)
    assert plan("auto", "hermes").constraint(True) is None
    named = plan({"type": "function", "function": {"name": "get_weather"}})
    assert named.constraint(True).json == WEATHER["function"]["parameters"]
    time_only = plan({"type": "function", "function": {"name": "get_time"}})
    assert time_only.constraint(True).json == {"type": "object"}  # no parameters: any object
    required = plan("required").constraint(True).json
    assert required["minItems"] == 1 and "maxItems" not in required
    names = [option["properties"]["name"] for option in required["items"]["anyOf"]]
    assert names == [{"const": "get_weather"}, {"const": "get_time"}]
    assert plan("required").constraint(False).json["maxItems"] == 1
    # The forced call's constraint reaches every choice's params, validated.
    for choice in chat_choices(
        request(tools=[WEATHER], tool_choice="required", n=2), plan=plan("required")
    ):
        assert choice.params.structured_outputs.json == plan("required").constraint(True).json
        assert choice.chat.tools == [WEATHER]


def test_replies_are_read_into_calls() -> None:
    required = plan("required")
    content, calls = required.read('[{"name": "get_weather", "parameters": {"city": "Paris"}}]')
    assert content is None
    assert [call["function"] for call in calls] == [
        {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    ]
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("chatcmpl-tool-")
    assert required.read('[{"name": "get_weather"') == ('[{"name": "get_weather"', [])  # cut
    named = plan(
        NamedToolChoice.model_validate({"type": "function", "function": {"name": "get_time"}})
    )
    assert named.read("{}")[1][0]["function"] == {"name": "get_time", "arguments": "{}"}
    assert plan("none").read("<tool_call>{}</tool_call>") == ("<tool_call>{}</tool_call>", [])


@pytest.mark.parametrize(
    ("text", "content", "functions"),
    [
        ("Just text.", "Just text.", []),
        (
            'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
            "</tool_call>",
            "Let me check.",
            [("get_weather", {"city": "Oslo"})],
        ),
        (
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n<tool_call>'
            '{"name": "get_weather", "arguments": {"city": "Rome"}}',  # the last one unclosed
            None,
            [("get_time", {}), ("get_weather", {"city": "Rome"})],
        ),
        ("<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
    ],
)
def test_the_hermes_parser(text: str, content: str | None, functions: list) -> None:
    read_content, calls = plan("auto", "hermes").read(text)
    assert read_content == content
    assert [
        (call["function"]["name"], json.loads(call["function"]["arguments"])) for call in calls
    ] == functions


def test_a_streamed_reply_holds_back_what_may_open_a_call() -> None:
    stream = ToolCallStream(plan("auto", "hermes"))
    sent = [
        stream.content(piece)
        for piece in ["Sure", ", <", "tool", "_c", "all>", '{"name": "get_time"}']
    ]
    assert sent == ["Sure", ",", "", "", "", ""]
    rest, calls = stream.finish()
    assert rest == "" and calls[0]["function"]["name"] == "get_time"
    # A "<" that opens no call is content once the text moves past it, or at the end.
    stream = ToolCallStream(plan("auto", "hermes"))
    assert [stream.content(piece) for piece in ["a <", "b", " <tool"]] == ["a", " <b", ""]
    assert stream.finish() == (" <tool", [])
    # A forced call streams no content at all.
    stream = ToolCallStream(plan("required"))
    assert stream.content('[{"name": "get_time", "parameters": {}}]') == ""
    assert stream.finish()[1][0]["function"] == {"name": "get_time", "arguments": "{}"}


def test_tool_turns_reach_the_pipeline() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    messages = chat_messages(
        request(
            messages=[
                {"role": "user", "content": "time?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "content": "noon", "tool_call_id": "c1"},
            ]
        )
    )
    assert messages == [
        ChatMessage("user", "time?"),
        ChatMessage("assistant", "", tool_calls=[call]),
        ChatMessage("tool", "noon", tool_call_id="c1"),
    ]
