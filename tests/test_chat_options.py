"""vLLM's chat template fields: the one check of them, which kwargs the template sees, and how
they travel to the tokenizer process."""

from __future__ import annotations

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


def test_options_travel_with_json_values() -> None:
    kwargs = {"enable_thinking": False, "n": 2**63 - 1, "x": [1.5, None, {"y": "z"}]}
    request = GenerateRequest(
        request_id="r",
        messages=[ChatMessage("user", "hi")],
        chat=ChatOptions(add_generation_prompt=False, chat_template_kwargs=kwargs),
    )
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(request), type=ClientMessage)
    assert decoded == request
    # A frame without them (a client written before them) decodes to the defaults.
    plain = msgspec.msgpack.encode({"type": "generate", "request_id": "r", "prompt": "hi"})
    assert msgspec.msgpack.decode(plain, type=ClientMessage).chat == ChatOptions()
