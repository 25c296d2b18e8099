"""Chat requests in the frontend without a pipeline: messages and vLLM's chat template fields
mapped to each choice, what is refused (400) and accepted, the reply's role, and echo."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from baton.chat_options import ChatOptions
from baton.frontend.chat import ChatChunkWriter, chat_body
from baton.frontend.chat_protocol import ChatCompletionRequest
from baton.frontend.errors import OpenAIError, from_validation_error
from baton.frontend.generation import ChoiceOutput
from baton.frontend.params import chat_choices
from baton.messages import ChatMessage, GenerateDelta, Usage


def test_chat_choices_messages_and_limits() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    request = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "system", "content": None}, {"role": "user", "content": parts}],
            "max_tokens": 9,
            "max_completion_tokens": 5,
            "logprobs": True,
        }
    )
    (choice,) = chat_choices(request)
    assert choice.prompt == [ChatMessage("system", ""), ChatMessage("user", "a\nb")]
    assert choice.params.max_tokens == 5  # max_completion_tokens wins
    assert choice.params.logprobs == 0  # logprobs without top_logprobs: the chosen token only


def chat_request(**fields: object) -> ChatCompletionRequest:
    """A chat request of one user message, with `fields` (JSON values)."""
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "Hi"}], **fields}
    )


def test_chat_template_options_reach_every_choice() -> None:
    kwargs = {"enable_thinking": False, "add_generation_prompt": True}
    request = chat_request(
        n=2, add_generation_prompt=False, continue_final_message=True, chat_template_kwargs=kwargs
    )
    expected = ChatOptions(
        add_generation_prompt=False, continue_final_message=True, chat_template_kwargs=kwargs
    )
    assert [choice.chat for choice in chat_choices(request)] == [expected, expected]
    assert chat_choices(chat_request())[0].chat == ChatOptions()


def test_documents_and_reasoning_effort_reach_the_chat_options() -> None:
    """vLLM's top-level template fields travel in ChatOptions, as the kwargs do."""
    documents = [{"title": "t", "text": "x"}]
    (choice,) = chat_choices(chat_request(documents=documents, reasoning_effort="none"))
    assert choice.chat == ChatOptions(documents=documents, reasoning_effort="none")


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"continue_final_message": True}, "continue_final_message", "Cannot set both"),
        (
            {"add_generation_prompt": True, "continue_final_message": True},
            "continue_final_message",
            "Cannot set both",
        ),
        ({"chat_template_kwargs": {"chat_template": "x"}}, "chat_template_kwargs", "templates"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "`messages`"),
        ({"chat_template_kwargs": {"x": [2**70]}}, "chat_template_kwargs", "64 bits"),
        ({"chat_template_kwargs": {"x": [math.nan]}}, "chat_template_kwargs", "finite, got nan"),
    ],
)
def test_chat_options_that_cannot_be_honoured_are_400(
    fields: dict, param: str, message: str
) -> None:
    with pytest.raises(OpenAIError) as refused:
        chat_choices(chat_request(**fields))
    assert (refused.value.status, refused.value.param) == (400, param)
    assert message in refused.value.message


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"tools": []}, "tools", "at least 1 item"),  # as OpenAI
        ({"chat_template": "{{ messages }}"}, "chat_template", "does not accept request chat"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort", "reasoning_effort: Input should be"),
        ({"documents": [{"title": 1}]}, "documents.0.title", "documents.0.title: Input should be"),
        ({"stream_options": {"include_usage": False}}, "stream_options", "`stream=True`"),
        ({"stream_options": {"include_usage": True}, "stream": False}, "stream_options", ""),
    ],
)
def test_chat_fields_vllm_refuses(fields: dict, param: str, message: str) -> None:
    with pytest.raises(ValidationError) as raised:
        chat_request(**fields)
    error = from_validation_error(raised.value)
    assert (error.status, error.param) == (400, param)
    assert message in error.message


def test_chat_fields_vllm_accepts() -> None:
    """tool_choice "none" (or null) needs no tools, and an empty stream_options says nothing:
    vLLM accepts both without `stream`; the chat template kwargs take any JSON."""
    for fields in (
        {"tool_choice": "none"},
        {"tool_choice": None, "chat_template": None},
        {"stream_options": {}},
        {"stream_options": None},
        {"chat_template_kwargs": {"enable_thinking": False, "n": -(2**63), "d": [{"a": None}]}},
    ):
        request = chat_request(**fields)
        assert not request.include_usage
    streamed = chat_request(stream=True, stream_options={"include_usage": True})
    assert streamed.include_usage


def test_the_reply_role_and_echo_follow_vllm() -> None:
    """After a generation prompt the reply is the assistant's; without one it continues the
    final message's role. `echo` repeats the final message when it has the reply's role."""
    parts = [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]
    user_then_assistant = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": parts},
    ]
    cases = [
        ({}, "assistant", ""),  # the final message is the user's: nothing to echo
        ({"add_generation_prompt": False}, "user", "Hi"),
        ({"messages": user_then_assistant}, "assistant", "Hel\nlo"),
        (
            {"messages": user_then_assistant, "add_generation_prompt": False},
            "assistant",
            "Hel\nlo",
        ),
    ]
    for fields, role, echoed in cases:
        request = chat_request(echo=True, **fields)
        assert (request.reply_role, request.echoed) == (role, echoed), fields
        assert chat_request(**fields).echoed == ""  # without echo


def test_echo_prefixes_the_content_whole_and_streamed() -> None:
    request = chat_request(
        messages=[{"role": "assistant", "content": "Once"}],
        add_generation_prompt=False,
        continue_final_message=True,
        echo=True,
        n=2,
    )
    choices = chat_choices(request)
    usage = Usage(prompt_tokens=5, completion_tokens=2, cached_tokens=0)
    envelope = {"id": "c", "object": "chat.completion", "created": 0, "model": "m"}
    outputs = [ChoiceOutput(i, 0, [7, 8], [" upon", " a"], [], "length", usage) for i in range(2)]
    body = chat_body(envelope, outputs, False, False, request.reply_role, request.echoed)
    messages = [choice["message"] for choice in body["choices"]]  # type: ignore[index]
    assert messages == [{"role": "assistant", "content": "Once upon a"}] * 2
    writer = ChatChunkWriter(envelope, choices, False, False, False, "assistant", "Once")
    first = GenerateDelta(request_id="c-1", token_ids=[7], text=" upon")
    last = GenerateDelta(
        request_id="c-1", token_ids=[8], text=" a", finished=True, finish_reason="length",
        usage=usage,
    )  # fmt: skip
    chunks = writer.chunks(1, first) + writer.chunks(1, last)
    deltas = [(c["choices"][0]["index"], c["choices"][0]["delta"]) for c in chunks]
    # As vLLM: the role chunk, then the echoed content as the first content delta.
    assert deltas == [
        (1, {"role": "assistant", "content": ""}),
        (1, {"content": "Once"}),
        (1, {"content": " upon"}),
        (1, {"content": " a"}),
    ]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "length"]
    plain = ChatChunkWriter(envelope, choices, False, False, False, "assistant", "")
    assert len(plain.chunks(0, first)) == 2  # no echo: no echo chunk


def test_a_conversation_is_scored_once_and_only_where_it_is_returned() -> None:
    """The response carries a conversation's prompt logprobs once, so only the first choice
    scores it; a streamed echo (no place for them, as in vLLM) scores nothing."""
    request = chat_request(n=3, prompt_logprobs=2)
    assert [c.params.prompt_logprobs for c in chat_choices(request)] == [2, None, None]
    echoed = chat_request(n=2, echo=True, logprobs=True, top_logprobs=1)
    assert [c.params.prompt_logprobs for c in chat_choices(echoed)] == [1, None]
    streamed = chat_request(echo=True, logprobs=True, top_logprobs=1, stream=True)
    assert [c.params.prompt_logprobs for c in chat_choices(streamed)] == [None]
