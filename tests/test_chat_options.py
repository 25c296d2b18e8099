"""vLLM's chat template fields: the one check of them, which kwargs the template sees, and how
they travel to the tokenizer process."""

from __future__ import annotations

import math
from datetime import datetime, timezone

import msgspec
import pytest

from baton.chat_options import REQUEST_TEMPLATE_REFUSED, ChatOptions, InvalidChatOption
from baton.messages import ChatMessage, ClientMessage, GenerateRequest


def test_defaults_render_a_generation_prompt_and_validate() -> None:
    options = ChatOptions()
    assert (options.add_generation_prompt, options.continue_final_message) == (True, False)
    options.validate()
    ChatOptions(add_generation_prompt=False, continue_final_message=True).validate()


@pytest.mark.parametrize(
    ("options", "param", "message"),
    [
        (
            ChatOptions(continue_final_message=True),
            "continue_final_message",
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
        ),
        (
            ChatOptions(chat_template_kwargs={"chat_template": "{{ 1 }}"}),
            "chat_template_kwargs",
            REQUEST_TEMPLATE_REFUSED,
        ),
        (ChatOptions(chat_template_kwargs={"tokenize": False}), "chat_template_kwargs", "tokenize"),
        (ChatOptions(chat_template_kwargs={"messages": []}), "chat_template_kwargs", "messages"),
        (ChatOptions(chat_template_kwargs={"tools": [{}]}), "chat_template_kwargs", "tools"),
    ],
)
def test_what_cannot_be_honoured_is_refused(options: ChatOptions, param: str, message: str) -> None:
    with pytest.raises(InvalidChatOption) as raised:
        options.validate()
    assert raised.value.param == param and message in str(raised.value)


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        (b"bytes", "got a value of type bytes"),
        (msgspec.msgpack.Ext(1, b"x"), "got a value of type Ext"),
        (datetime(2026, 1, 1, tzinfo=timezone.utc), "got a value of type datetime"),
        ({"nested": {1: "a"}}, "object keys must be strings, got int"),
        ([1.5, math.nan], "numbers must be finite, got nan"),
        ({"x": [math.inf]}, "numbers must be finite, got inf"),
        (-math.inf, "numbers must be finite, got -inf"),
        (2**64, "integers must fit in 64 bits"),
        ([-(2**63) - 1], "integers must fit in 64 bits"),
        ((1, 2), "got a value of type tuple"),
    ],
)
def test_kwargs_must_hold_json_values(value: object, problem: str) -> None:
    """A ZMQ client's msgpack carries more than JSON (bytes, extensions, timestamps, integer
    keys), which would reach the prompt as Python reprs; JSON over HTTP carries NaN and
    Infinity. Both are refused, as the kwargs anywhere in them."""
    with pytest.raises(InvalidChatOption) as raised:
        ChatOptions(chat_template_kwargs={"v": value}).validate()
    assert raised.value.param == "chat_template_kwargs"
    assert str(raised.value) == f"chat_template_kwargs must hold JSON values: {problem}"


def test_any_json_value_is_accepted_however_deep() -> None:
    deep: list = []
    for _ in range(100_000):  # a loop, not recursion, checks them
        deep = [deep]
    values = [None, True, "s", 2**64 - 1, -(2**63), 0.5, [{"a": [{}]}], deep]
    ChatOptions(chat_template_kwargs={str(i): v for i, v in enumerate(values)}).validate()


def test_the_request_fields_win_over_kwargs_of_the_same_name() -> None:
    """vLLM merges the request's add_generation_prompt and continue_final_message over the
    kwargs; everything else (documents, special tokens, any variable) reaches the template."""
    kwargs = {
        "add_generation_prompt": False,
        "continue_final_message": True,
        "enable_thinking": False,
        "documents": [{"title": "t", "text": "x"}],
    }
    options = ChatOptions(chat_template_kwargs=kwargs)
    options.validate()
    assert options.template_variables == {
        "enable_thinking": False,
        "documents": [{"title": "t", "text": "x"}],
    }


def test_documents_and_reasoning_effort_reach_the_template_as_vllm_merges_them() -> None:
    """vLLM's top-level fields: where set they win over same-named kwargs; the effort also sets
    enable_thinking ("none": off, any other level: on) unless the kwargs name it."""
    documents = [{"title": "t", "text": "x"}]
    kwargs = {"documents": [{"title": "old"}], "reasoning_effort": "low", "x": 1}
    options = ChatOptions(chat_template_kwargs=kwargs, documents=documents)
    assert options.template_variables == {**kwargs, "documents": documents}
    assert ChatOptions(chat_template_kwargs=kwargs).template_variables == kwargs
    for effort, thinking in (("none", False), ("minimal", True), ("high", True), ("max", True)):
        variables = ChatOptions(
            chat_template_kwargs=kwargs, reasoning_effort=effort
        ).template_variables
        assert variables == {**kwargs, "reasoning_effort": effort, "enable_thinking": thinking}
    chosen = {"enable_thinking": True}
    none = ChatOptions(chat_template_kwargs=chosen, reasoning_effort="none").template_variables
    assert none == {"enable_thinking": True, "reasoning_effort": "none"}


def test_options_travel_with_json_values() -> None:
    kwargs = {"enable_thinking": False, "n": 2**63 - 1, "x": [1.5, None, {"y": "z"}]}
    request = GenerateRequest(
        request_id="r",
        messages=[ChatMessage("user", "hi")],
        chat=ChatOptions(
            add_generation_prompt=False,
            chat_template_kwargs=kwargs,
            documents=[{"title": "t", "text": "x"}],
            reasoning_effort="none",
        ),
    )
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(request), type=ClientMessage)
    assert decoded == request
    # A frame without them (a client written before them) decodes to the defaults.
    plain = msgspec.msgpack.encode({"type": "generate", "request_id": "r", "prompt": "hi"})
    assert msgspec.msgpack.decode(plain, type=ClientMessage).chat == ChatOptions()
