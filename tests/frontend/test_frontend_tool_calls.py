"""Tool calls over HTTP through the official client: forced calls ("required", a named
function) on stories260K, read back into `tool_calls`, streamed and not; "auto" refused without
the server's flags, and read by the hermes and llama3_json parsers on servers that have them."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest
from helpers.frontend_http import run_frontend

from baton.config import BatonConfig

from .conftest import MODEL_NAME

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_a_required_call_comes_back_as_tool_calls(client: openai.OpenAI) -> None:
    """One call at most (a small model would otherwise go on adding calls to max_tokens)."""
    response = client.chat.completions.create(
        model=MODEL_NAME,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=80,
        temperature=0,
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        arguments = json.loads(call.function.arguments)
        if call.function.name == "get_weather":
            assert arguments["city"] in ("Paris", "Oslo")
        else:
            assert call.function.name == "get_time" and arguments == {}


def test_a_named_call_streamed_and_not(client: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    response = client.chat.completions.create(
        model=MODEL_NAME,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice=named,
        max_tokens=40,
        temperature=0,
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop"  # a forced call ends as OpenAI's does
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice=named,
        max_tokens=40,
        temperature=0,
        stream=True,
    )
    chunks = list(stream)
    assert not any(chunk.choices[0].delta.content for chunk in chunks if chunk.choices)
    (streamed,) = [tool for chunk in chunks for tool in chunk.choices[0].delta.tool_calls or ()]
    assert (streamed.index, streamed.function.arguments) == (0, call.function.arguments)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_auto_needs_the_servers_flags(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice"):
        client.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=[WEATHER])
    # "none" offers the tools to the template but never reads calls.
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=5
    )
    assert response.choices[0].message.tool_calls is None


# Replies shaped by a regex (a random model says nothing of its own accord), in each parser's
# format: hermes, text then a call; llama3_json, the call alone as JSON. With the content each
# leaves (None: only calls).
REPLIES = {
    "hermes": (
        r'Checking\. <tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Oslo)"\}\}'
        r"</tool_call>",
        "Checking.",
    ),
    "llama3_json": (r'\{"name": "get_weather", "parameters": \{"city": "(Paris|Oslo)"\}\}', None),
}


@pytest.fixture(scope="module", params=sorted(REPLIES))
def auto_tools(request: pytest.FixtureRequest) -> Iterator[tuple[openai.OpenAI, str]]:
    """The built-in model with --enable-auto-tool-choice and each --tool-call-parser."""
    for config in run_frontend(
        max_model_len=512, enable_auto_tool_choice=True, tool_call_parser=request.param
    ):
        yield openai.OpenAI(base_url=_v1(config), api_key="unused", max_retries=0), request.param


def _v1(config: BatonConfig) -> str:
    return f"http://{config.host}:{config.port}/v1"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_auto_calls_are_read_by_the_servers_parser(
    auto_tools: tuple[openai.OpenAI, str], stream: bool
) -> None:
    client, parser = auto_tools
    regex, want_content = REPLIES[parser]
    response = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=ASK,
        tools=[WEATHER],
        max_tokens=120,
        temperature=0,
        stream=stream,
        extra_body={"structured_outputs": {"regex": regex}},
    )
    if stream:
        chunks = [chunk.choices[0] for chunk in response if chunk.choices]
        # Text the parser holds back sends no empty chunks.
        assert all(
            choice.delta.role or choice.delta.content or choice.delta.tool_calls
            for choice in chunks[:-1]
        )
        content = "".join(choice.delta.content or "" for choice in chunks) or None
        calls = [call for choice in chunks for call in choice.delta.tool_calls or ()]
        finish_reason = chunks[-1].finish_reason
    else:
        message = response.choices[0].message
        content, calls, finish_reason = (
            message.content,
            message.tool_calls,
            response.choices[0].finish_reason,
        )
    assert content == want_content
    (call,) = calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")
    assert finish_reason == "tool_calls"
