"""The tool-call parsers: the llama3_json format as vLLM's parser reads it, held back while a
streamed reply may still be calls; every --tool-call-parser choice has a parser."""

from __future__ import annotations

import json

import pytest

from baton.config import TOOL_CALL_PARSERS
from baton.frontend.tool_parsers import PARSERS
from baton.frontend.tools import ToolCallStream, ToolPlan

LLAMA3 = PARSERS["llama3_json"]


def test_every_parser_choice_has_a_parser() -> None:
    assert set(PARSERS) == set(TOOL_CALL_PARSERS)


@pytest.mark.parametrize(
    ("text", "content", "functions"),
    [
        ("Just text.", "Just text.", []),
        (
            '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
            None,
            [("get_weather", {"city": "Oslo"})],
        ),
        (  # after the python tag, "arguments" too, two calls separated by ";"
            '<|python_tag|>{"name": "get_time", "arguments": {}}; '
            '{"name": "get_weather", "parameters": {"city": "Rome"}}\n',
            None,
            [("get_time", {}), ("get_weather", {"city": "Rome"})],
        ),
        ('  {"name": "get_time", "parameters": {}}', None, [("get_time", {})]),
        ('Here: {"name": "get_time", "parameters": {}}', None, None),  # text first: content
        ('{"name": "get_time", "parameters": {}', None, None),  # cut short
        ('{"name": "get_time", "parameters": [1]}', None, None),  # arguments not an object
        ('{"name": 7, "parameters": {}}', None, None),
        ('{"parameters": {}}', None, None),
    ],
)
def test_the_llama3_json_parser(text: str, content: str | None, functions: list | None) -> None:
    read_content, calls = LLAMA3.read(text)
    if functions is None:  # no calls: the reply stays content, whole
        assert (read_content, calls) == (text, [])
        return
    assert read_content == content
    assert [
        (call["function"]["name"], json.loads(call["function"]["arguments"])) for call in calls
    ] == functions
    assert all(call["id"].startswith("chatcmpl-tool-") for call in calls)


def stream_of(parser: str) -> ToolCallStream:
    return ToolCallStream(ToolPlan("auto", parser=parser))


def test_a_streamed_llama3_reply_is_content_once_it_opens_as_text() -> None:
    stream = stream_of("llama3_json")
    assert [stream.content(piece) for piece in [" ", "\n", "Sure", ", it is"]] == [
        "",
        "",
        " \nSure",
        ", it is",
    ]
    assert stream.finish() == ("", [])
    # What may still be the python tag is held back, then sent when it is not.
    stream = stream_of("llama3_json")
    assert [stream.content(piece) for piece in ["<|py", "thon", "!"]] == ["", "", "<|python!"]


def test_a_streamed_llama3_call_sends_no_content() -> None:
    stream = stream_of("llama3_json")
    pieces = ['{"name": ', '"get_time", ', '"parameters": {}}']
    assert [stream.content(piece) for piece in pieces] == ["", "", ""]
    rest, calls = stream.finish()
    assert rest == "" and calls[0]["function"] == {"name": "get_time", "arguments": "{}"}
    # A reply that opened as a call but does not parse is content at the end, whole.
    stream = stream_of("llama3_json")
    assert stream.content('{"oops": 1}') == ""
    assert stream.finish() == ('{"oops": 1}', [])
