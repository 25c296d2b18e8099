"""--reasoning-parser over HTTP, on a tiny thinking model (its template opens a <think> block
for the reply): the reply's reasoning comes back apart from its content, streamed and not; a
prompt that closed the block gets content alone; a constraint and forced tool calls apply
after the reasoning, which stays as the model reasons unconstrained.

A random model rarely closes the block of its own accord, so a logit bias on </think> makes it
close after its first reasoning token. What a reply should be comes from the same prompt's
completion: completions are never split."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from helpers.frontend_http import base_url, run_frontend
from helpers.tiny_models import write_thinking_checkpoint

END = 260  # write_thinking_checkpoint's </think>
ASK = [{"role": "user", "content": "Hi"}]
# Greedy, and </think> likely enough to close the block after one token of reasoning.
CLOSES = {"max_tokens": 16, "temperature": 0, "logit_bias": {str(END): 3}}
NOT_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    model = write_thinking_checkpoint(tmp_path_factory.mktemp("thinking"))
    for config in run_frontend(
        model=str(model),
        reasoning_parser="qwen3",
        enable_auto_tool_choice=True,
        tool_call_parser="hermes",
    ):
        with httpx.Client(base_url=base_url(config), timeout=60) as client:
            yield client


def chat(server: httpx.Client, **fields: object) -> dict:
    response = server.post("/v1/chat/completions", json={"messages": ASK, **CLOSES, **fields})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def completed(server: httpx.Client, **fields: object) -> str:
    """The raw text of the chat's reply: its rendered prompt, completed."""
    chat_fields = {key: value for key, value in fields.items() if key == "chat_template_kwargs"}
    tokens = server.post("/tokenize", json={"messages": ASK, **chat_fields}).json()["tokens"]
    body = {"prompt": tokens, **CLOSES, **fields}
    body.pop("chat_template_kwargs", None)
    response = server.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def streamed(server: httpx.Client, **fields: object) -> tuple[str, str, list[dict]]:
    """A streamed reply's reasoning and content, and its deltas."""
    body = {"messages": ASK, **CLOSES, **fields, "stream": True}
    deltas = []
    with server.stream("POST", "/v1/chat/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                deltas += [choice["delta"] for choice in json.loads(line[6:])["choices"]]
    reasoning = "".join(delta.get("reasoning") or "" for delta in deltas)
    content = "".join(delta.get("content") or "" for delta in deltas)
    return reasoning, content, deltas


def test_the_reasoning_comes_back_apart_from_the_content(server: httpx.Client) -> None:
    raw = completed(server)
    reasoning, tag, content = raw.partition("</think>")
    assert tag and reasoning and content  # the bias closed the block after some reasoning
    message = chat(server)["message"]
    assert (message["reasoning"], message["content"]) == (reasoning, content)
    streamed_reasoning, streamed_content, deltas = streamed(server)
    assert (streamed_reasoning, streamed_content) == (reasoning, content)
    # The reasoning streams first, as its own deltas; no delta is empty.
    kinds = [key for delta in deltas[1:] for key in ("reasoning", "content") if delta.get(key)]
    assert kinds[0] == "reasoning" and "reasoning" not in kinds[kinds.index("content") :]
    assert all(delta.get("reasoning") or delta.get("content") for delta in deltas[1:-1])


def test_a_reply_cut_before_the_block_closes_is_all_reasoning(server: httpx.Client) -> None:
    choice = chat(server, logit_bias={}, max_tokens=6)
    assert choice["finish_reason"] == "length"
    assert choice["message"]["content"] is None
    assert choice["message"]["reasoning"] == completed(server, logit_bias={}, max_tokens=6)


def test_a_prompt_that_closed_the_block_gets_content_alone(server: httpx.Client) -> None:
    message = chat(server, **NOT_THINKING)["message"]
    assert message["reasoning"] is None
    assert message["content"] == completed(server, **NOT_THINKING)
    reasoning, content, _ = streamed(server, **NOT_THINKING)
    assert (reasoning, content) == ("", message["content"])


def test_include_reasoning_false_drops_it(server: httpx.Client) -> None:
    content = completed(server).partition("</think>")[2]
    message = chat(server, include_reasoning=False)["message"]
    assert (message["reasoning"], message["content"]) == (None, content)
    reasoning, streamed_content, _ = streamed(server, include_reasoning=False)
    assert (reasoning, streamed_content) == ("", content)


def test_a_constraint_applies_after_the_reasoning(server: httpx.Client) -> None:
    """The reasoning is the unconstrained reply's; the content follows the regex (which
    forbids </think>, so the model could not have closed the block under it)."""
    reasoning = completed(server).partition("</think>")[0]
    constrained = {"structured_outputs": {"regex": "[ab]{5}"}}
    choice = chat(server, **constrained)
    assert choice["message"]["reasoning"] == reasoning
    assert re.fullmatch("[ab]{5}", choice["message"]["content"])
    assert choice["finish_reason"] == "stop"
    # A prompt that closed the block is constrained from its first token.
    choice = chat(server, **constrained, **NOT_THINKING)
    assert choice["message"]["reasoning"] is None
    assert re.fullmatch("[ab]{5}", choice["message"]["content"])


def test_forced_tool_calls_are_read_from_the_content(server: httpx.Client) -> None:
    named = {"type": "function", "function": {"name": "pick"}}
    choice = chat(server, tools=[PICK], tool_choice=named, max_tokens=40)
    assert choice["message"]["reasoning"] == completed(server).partition("</think>")[0]
    assert choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"])["letter"] in ("a", "b")


PICK = {
    "type": "function",
    "function": {
        "name": "pick",
        "parameters": {
            "type": "object",
            "properties": {"letter": {"enum": ["a", "b"]}},
            "required": ["letter"],
        },
    },
}


def test_auto_tool_calls_are_read_from_the_content_streamed_and_not(server: httpx.Client) -> None:
    """The hermes parser reads the content after the reasoning: a regex shapes the content (a
    random model calls nothing of its own accord), and the reasoning stays apart."""
    reply = (
        r'Checking\. <tool_call>\{"name": "pick", "arguments": \{"letter": "(a|b)"\}\}</tool_call>'
    )
    fields = {"tools": [PICK], "max_tokens": 120, "structured_outputs": {"regex": reply}}
    reasoning = completed(server).partition("</think>")[0]
    choice = chat(server, **fields)
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert (message["reasoning"], message["content"]) == (reasoning, "Checking.")
    (call,) = message["tool_calls"]
    assert json.loads(call["function"]["arguments"])["letter"] in ("a", "b")
    streamed_reasoning, content, deltas = streamed(server, **fields)
    assert (streamed_reasoning, content) == (reasoning, "Checking.")
    (streamed_call,) = [call for delta in deltas for call in delta.get("tool_calls") or ()]
    assert streamed_call["function"] == call["function"]


def test_an_assistant_turns_reasoning_is_taken_back(server: httpx.Client) -> None:
    """As vLLM's: `reasoning`, or its older name `reasoning_content`, reach the template."""
    turns = [
        {"role": "assistant", "content": "Hello.", name: "Greet."}
        for name in ("reasoning", "reasoning_content")
    ]
    prompts = [
        server.post("/tokenize", json={"messages": [*ASK, turn]}).json()["tokens"] for turn in turns
    ]
    assert prompts[0] == prompts[1]
    text = server.post("/detokenize", json={"tokens": prompts[0]}).json()["prompt"]
    assert "<think>Greet.</think>Hello." in text


def test_a_server_without_the_parser_returns_no_reasoning(
    client: openai.OpenAI, stories260k_dir: Path
) -> None:
    response = client.chat.completions.with_raw_response.create(
        model="stories-test", messages=ASK, max_tokens=4
    )
    assert "reasoning" not in response.http_response.json()["choices"][0]["message"]
