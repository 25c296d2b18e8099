"""OpenAI's Responses API (`POST /v1/responses`), stateless as vLLM serves it, through the
official client and raw HTTP on stories260K: the chat path's greedy replies (the offline
engine's, on the rendered conversation), typed stream events, max_output_tokens, structured
outputs, forced tool calls, function call items as input, refusals; on a tiny thinking model,
reasoning items. The event writer is checked against the non-streamed body on one reply."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest
from helpers.frontend_http import MODEL_NAME, assert_error, base_url, greedy, run_frontend
from helpers.tiny_models import write_thinking_checkpoint

from baton import LLM
from baton.config import BatonConfig
from baton.frontend.errors import OpenAIError
from baton.frontend.generation import ChoiceOutput
from baton.frontend.responses import response_body
from baton.frontend.responses_output import ResponseShell
from baton.frontend.responses_stream import ResponseEventWriter
from baton.frontend.tools import ToolPlan
from baton.messages import ChatMessage, GenerateDelta, Usage
from baton.tokenizer_proc.chat import render_chat

GREEDY = {"temperature": 0}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Oslo"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
TIME = {
    "type": "function",
    "name": "get_time",
    "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
}
ASK = "What is the weather in Paris?"


def as_chat_tool(tool: dict) -> dict:
    """A Responses function tool in chat's shape."""
    return {"type": "function", "function": {key: tool[key] for key in ("name", "parameters")}}


@pytest.fixture(scope="module")
def http(frontend: BatonConfig) -> Iterator[httpx.Client]:
    """Raw HTTP to the stories260K server."""
    with httpx.Client(base_url=base_url(frontend), timeout=60) as client:
        yield client


def events_of(http: httpx.Client, body: dict) -> list[dict]:
    """A streamed response's events, each checked for OpenAI's framing: `event:` names the
    data's type, sequence numbers count from 0, no [DONE]."""
    with http.stream("POST", "/v1/responses", json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        text = response.read().decode()
    assert "[DONE]" not in text and text.endswith("\n\n")
    events = []
    for block in text.removesuffix("\n\n").split("\n\n"):
        name, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        events.append(event)
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    return events


def without_ids(items: list[dict]) -> list[dict]:
    return [
        {key: value for key, value in item.items() if key not in ("id", "call_id")}
        for item in items
    ]


def test_string_input_is_the_chat_paths_greedy_reply(client: openai.OpenAI, offline: LLM) -> None:
    rendered = render_chat(offline.tokenizer, [ChatMessage("user", "Tell me about a cat.")])
    expected = greedy(offline, rendered, max_tokens=24)
    assert expected.finish_reason == "length"
    response = client.responses.create(
        model=MODEL_NAME, input="Tell me about a cat.", max_output_tokens=24, **GREEDY
    )
    assert response.id.startswith("resp_") and response.object == "response"
    (message,) = response.output
    assert (message.type, message.role) == ("message", "assistant")
    assert message.id.startswith("msg_")
    assert response.output_text == expected.text
    assert response.usage.input_tokens == len(rendered)
    assert response.usage.output_tokens == len(expected.token_ids)
    assert response.usage.total_tokens == len(rendered) + len(expected.token_ids)
    # Cut by max_output_tokens: incomplete, and so is the message.
    assert response.status == "incomplete" and message.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    # A stop string (vLLM's sampling extension, as chat takes it) ends it complete.
    stop = max(expected.text.split()[2:8], key=len)  # a word, not a letter of an earlier one
    stopped = client.responses.create(
        model=MODEL_NAME,
        input="Tell me about a cat.",
        max_output_tokens=24,
        extra_body={"stop": [stop]},
        **GREEDY,
    )
    assert stopped.status == "completed" and stopped.incomplete_details is None
    assert stopped.output_text == expected.text[: expected.text.index(stop)]
    assert stopped.output[0].status == "completed"
    # OpenAI's default tool choice, "auto", with no tools: nothing to choose from, no error.
    for tools in ([], None):
        plain = client.responses.create(
            model=MODEL_NAME,
            input="Tell me about a cat.",
            max_output_tokens=24,
            tool_choice="auto",
            **({"tools": tools} if tools is not None else {}),
            **GREEDY,
        )
        assert plain.output_text == expected.text


def test_messages_and_instructions_render_as_chat_messages(
    client: openai.OpenAI, offline: LLM
) -> None:
    """Instructions come first as a system message, a developer message is a system one, and
    text parts join as chat's do; settings are echoed."""
    response = client.responses.create(
        model=MODEL_NAME,
        instructions="You tell stories.",
        input=[
            {"role": "developer", "content": "Keep them short."},
            {"role": "user", "content": [{"type": "input_text", "text": "Tell me a story."}]},
            {"type": "message", "role": "assistant", "content": "Once there was a dog."},
            {"role": "user", "content": "Another one."},
        ],
        max_output_tokens=20,
        metadata={"run": "7"},
        **GREEDY,
    )
    conversation = [
        ChatMessage("system", "You tell stories."),
        ChatMessage("system", "Keep them short."),
        ChatMessage("user", "Tell me a story."),
        ChatMessage("assistant", "Once there was a dog."),
        ChatMessage("user", "Another one."),
    ]
    rendered = render_chat(offline.tokenizer, conversation)
    assert response.output_text == greedy(offline, rendered, max_tokens=20).text
    assert response.usage.input_tokens == len(rendered)
    assert response.instructions == "You tell stories."
    assert response.metadata == {"run": "7"}
    assert (response.temperature, response.max_output_tokens) == (0, 20)
    assert response.store is False  # nothing is stored


def test_streamed_events_come_in_order_and_add_up(
    client: openai.OpenAI, http: httpx.Client
) -> None:
    body = {"model": MODEL_NAME, "input": "Tell me about a dog.", "max_output_tokens": 16, **GREEDY}
    whole = http.post("/v1/responses", json=body).json()
    events = events_of(http, body)
    kinds = [event["type"] for event in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas > 1
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        f"response.{whole['status']}",
    ]
    assert events[0]["response"]["status"] == "in_progress"
    assert events[0]["response"]["output"] == []
    item_id = events[2]["item"]["id"]
    text = "".join(event["delta"] for event in events if event["type"].endswith("text.delta"))
    assert text == whole["output"][0]["content"][0]["text"]
    assert all(event.get("item_id", item_id) == item_id for event in events[3:-2])
    final = events[-1]["response"]
    assert final["output"] == [events[-2]["item"]] and final["output"][0]["id"] == item_id
    assert without_ids(final["output"]) == without_ids(whole["output"])
    counted = ("input_tokens", "output_tokens", "total_tokens")  # the second hits the cache
    assert [final["usage"][key] for key in counted] == [whole["usage"][key] for key in counted]
    assert final["incomplete_details"] == whole["incomplete_details"]
    # The official client reads the same events.
    stream = client.responses.create(**body, stream=True)
    parsed = list(stream)
    assert [event.type for event in parsed] == kinds
    assert parsed[-1].response.output_text == text


def test_output_logprobs_are_chats(client: openai.OpenAI, http: httpx.Client) -> None:
    body = {
        "model": MODEL_NAME,
        "input": "Hi",
        "max_output_tokens": 6,
        "include": ["message.output_text.logprobs"],
        "top_logprobs": 2,
        **GREEDY,
    }
    part = http.post("/v1/responses", json=body).json()["output"][0]["content"][0]
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=6,
        logprobs=True,
        top_logprobs=2,
        **GREEDY,
    )
    expected = [entry.model_dump() for entry in chat.choices[0].logprobs.content]
    assert part["logprobs"] == expected and len(expected) == 6
    events = events_of(http, body)
    streamed = [entry for event in events if "delta" in event for entry in event["logprobs"]]
    assert streamed == expected
    assert events[-1]["response"]["output"][0]["content"][0]["logprobs"] == expected


def test_a_json_schema_text_format_is_followed(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"animal": {"enum": ["cat", "dog"]}, "happy": {"type": "boolean"}},
        "required": ["animal", "happy"],
        "additionalProperties": False,
    }
    response = client.responses.create(
        model=MODEL_NAME,
        input="Tell me about a pet.",
        max_output_tokens=60,
        text={"format": {"type": "json_schema", "name": "pet", "schema": schema, "strict": True}},
        **GREEDY,
    )
    assert response.status == "completed"
    value = json.loads(response.output_text)
    assert set(value) == {"animal", "happy"} and value["animal"] in ("cat", "dog")
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Tell me about a pet."}],
        max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": schema}},
        **GREEDY,
    )
    assert response.output_text == chat.choices[0].message.content
    assert response.text.format.type == "json_schema"


@pytest.mark.parametrize(
    ("tool_choice", "chat_choice"),
    [
        ("required", "required"),
        (
            {"type": "function", "name": "get_weather"},
            {"type": "function", "function": {"name": "get_weather"}},
        ),
    ],
    ids=["required", "named"],
)
def test_forced_calls_are_function_call_items(
    client: openai.OpenAI, http: httpx.Client, tool_choice: object, chat_choice: object
) -> None:
    common = {"max_output_tokens": 80, "parallel_tool_calls": False, **GREEDY}
    body = {"model": MODEL_NAME, "input": ASK, "tools": [WEATHER, TIME], "tool_choice": tool_choice}
    response = client.responses.create(**body, **common)
    (call,) = response.output
    assert call.type == "function_call" and call.status == "completed"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": ASK}],
        tools=[as_chat_tool(WEATHER), as_chat_tool(TIME)],
        tool_choice=chat_choice,
        max_tokens=80,
        parallel_tool_calls=False,
        **GREEDY,
    )
    (expected,) = chat.choices[0].message.tool_calls
    assert (call.name, call.arguments) == (expected.function.name, expected.function.arguments)
    json.loads(call.arguments)
    events = events_of(http, {**body, **common})
    kinds = [event["type"] for event in events]
    assert kinds[2:] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[3]["delta"] == events[4]["arguments"] == call.arguments
    assert without_ids(events[-1]["response"]["output"]) == without_ids([call.to_dict()])


def test_function_call_items_render_as_chat_tool_turns(
    client: openai.OpenAI, http: httpx.Client
) -> None:
    """A function_call item is an assistant turn's tool call and its output the tool turn:
    the prompt is chat's, token for token (the fallback template writes the call)."""
    arguments = '{"city": "Paris"}'
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": arguments},
    }
    messages = [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny."},
    ]
    tokenize = {"messages": messages, "tools": [as_chat_tool(WEATHER)]}
    count = http.post("/tokenize", json=tokenize).json()["count"]
    uncalled = [messages[0], {"role": "assistant", "content": ""}, messages[2]]
    assert http.post("/tokenize", json={"messages": uncalled}).json()["count"] != count
    response = client.responses.create(
        model=MODEL_NAME,
        input=[
            {"role": "user", "content": ASK},
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "get_weather",
                "arguments": arguments,
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "Sunny."},
        ],
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=16,
        **GREEDY,
    )
    assert response.usage.input_tokens == count
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        tools=[as_chat_tool(WEATHER)],
        tool_choice="none",
        max_tokens=16,
        **GREEDY,
    )
    assert response.output_text == chat.choices[0].message.content


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"background": True}, "background"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"truncation": "auto"}, "truncation"),
        ({"max_tool_calls": 2}, "max_tool_calls"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
        ({"text": {"format": {"type": "json_schema", "schema": {"type": 7}}}}, "text.format"),
        ({"temperature": -1}, "temperature"),
        ({"top_k": "many"}, "top_k"),
        ({"tool_choice": "required"}, "tool_choice"),  # no tools to call
        ({"tools": [WEATHER]}, "tool_choice"),  # "auto" needs the server's parser
    ],
)
def test_what_cannot_be_honoured_is_a_400_naming_it(
    http: httpx.Client, fields: dict, param: str
) -> None:
    body = {"model": MODEL_NAME, "input": "Hi", "max_output_tokens": 4, **fields}
    error = assert_error(http.post("/v1/responses", json=body), 400, "invalid_request")
    assert error["param"] == param
    streamed = http.post("/v1/responses", json={**body, "stream": True})
    assert assert_error(streamed, 400, "invalid_request")["param"] == param


def test_an_unknown_model_is_a_404(client: openai.OpenAI, http: httpx.Client) -> None:
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="nope", input="Hi")
    error = assert_error(
        http.post("/v1/responses", json={"model": "nope", "input": "Hi"}), 404, "model_not_found"
    )
    assert error["param"] == "model"


def test_the_event_writer_lays_out_what_the_body_does() -> None:
    """Reasoning, content and an auto call (hermes), streamed in pieces that split the tags:
    the streamed items equal the non-streamed body's, and each item streams its text."""
    shell = ResponseShell("resp_1", 0, MODEL_NAME, {})
    plan = ToolPlan("auto", parser="hermes")
    pieces = [
        "<think>Wea",
        "ther?</th",
        "ink>Let me <tool",
        '_call>{"name": "get_time", ',
        '"arguments": {}}</tool_call>',
    ]
    usage = Usage(prompt_tokens=3, completion_tokens=5, cached_tokens=0)
    writer = ResponseEventWriter(shell, plan, splits_reasoning=True, logprobs=None)
    events = writer.chunks(
        0, GenerateDelta(request_id="r", token_ids=[], text="", admission=True, in_reasoning=True)
    )
    for number, piece in enumerate(pieces, 1):
        finished = number == len(pieces)
        delta = GenerateDelta(
            request_id="r",
            token_ids=[number],
            text=piece,
            finished=finished,
            finish_reason="stop" if finished else None,
            usage=usage if finished else None,
        )
        events += writer.chunks(0, delta)
    output = ChoiceOutput(0, 0, texts=pieces, finish_reason="stop", usage=usage, in_reasoning=True)
    whole = response_body(shell, output, plan, splits_reasoning=True, logprobs=None)
    final = events[-1]
    assert final["type"] == "response.completed"
    assert without_ids(final["response"]["output"]) == without_ids(whole["output"])
    assert [item["type"] for item in whole["output"]] == ["reasoning", "message", "function_call"]
    reasoning = "".join(
        event["delta"] for event in events if event["type"] == "response.reasoning_text.delta"
    )
    text = "".join(
        event["delta"] for event in events if event["type"] == "response.output_text.delta"
    )
    assert (reasoning, text) == ("Weather?", "Let me")
    done = [event["item"] for event in events if event["type"] == "response.output_item.done"]
    assert done == final["response"]["output"]
    # An error once the headers are out is OpenAI's `error` event, next in sequence.
    name, data = writer.encode(writer.error_chunks(OpenAIError(503, "gone"))).split(b"\n")[:2]
    assert name == b"event: error"
    assert json.loads(data.removeprefix(b"data: ")) == {
        "type": "error",
        "sequence_number": len(events),
        "code": "unavailable",
        "message": "gone",
        "param": None,
    }


# A tiny thinking model: its template opens a <think> block for the reply; a bias on </think>
# (its id) makes it close after some reasoning.
THINKING = {"input": "Hi", "max_output_tokens": 16, "logit_bias": {"260": 3}, **GREEDY}


@pytest.fixture(scope="module")
def thinking(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    model = write_thinking_checkpoint(tmp_path_factory.mktemp("thinking"))
    for config in run_frontend(model=str(model), reasoning_parser="qwen3"):
        with httpx.Client(base_url=base_url(config), timeout=60) as client:
            yield client


def thinking_chat(server: httpx.Client, **fields: object) -> dict:
    body = {
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 16,
        "logit_bias": {"260": 3},
        **GREEDY,
        **fields,
    }
    return server.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]


def test_the_reasoning_is_a_reasoning_item(thinking: httpx.Client) -> None:
    message = thinking_chat(thinking)
    assert message["reasoning"] and message["content"]
    response = thinking.post("/v1/responses", json=THINKING).json()
    reasoning, answer = response["output"]
    assert reasoning["type"] == "reasoning" and reasoning["summary"] == []
    assert reasoning["content"] == [{"type": "reasoning_text", "text": message["reasoning"]}]
    assert answer["content"][0]["text"] == message["content"]
    events = events_of(thinking, THINKING)
    kinds = [event["type"] for event in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    streamed = "".join(
        event["delta"] for event in events if event["type"] == "response.reasoning_text.delta"
    )
    assert streamed == message["reasoning"]
    assert without_ids(events[-1]["response"]["output"]) == without_ids(response["output"])
    # Effort "none" reaches the template, which closes the block: content alone.
    unthinking = {**THINKING, "reasoning": {"effort": "none"}}
    response = thinking.post("/v1/responses", json=unthinking).json()
    (answer,) = response["output"]
    assert (
        answer["content"][0]["text"] == thinking_chat(thinking, reasoning_effort="none")["content"]
    )
    assert response["reasoning"] == {"effort": "none", "summary": None}


def test_a_reasoning_item_reaches_the_template(thinking: httpx.Client) -> None:
    """It is its turn's reasoning, which the thinking template writes."""
    body = {
        "input": [
            {"role": "user", "content": "Hi"},
            {
                "type": "reasoning",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "Greet."}],
            },
            {"role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
            {"role": "user", "content": "Again"},
        ],
        "max_output_tokens": 1,
    }
    response = thinking.post("/v1/responses", json=body).json()
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning": "Greet."},
        {"role": "user", "content": "Again"},
    ]
    count = thinking.post("/tokenize", json={"messages": messages}).json()["count"]
    without = thinking.post(
        "/tokenize",
        json={"messages": [messages[0], {"role": "assistant", "content": "Hello!"}, messages[2]]},
    ).json()["count"]
    assert response["usage"]["input_tokens"] == count != without
