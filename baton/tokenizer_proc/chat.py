"""Chat messages -> prompt token ids.

A tokenizer with a `chat_template` renders the conversation with it, as vLLM and Hugging Face
do, under the request's `ChatOptions` (generation prompt, final message left open, template
variables). A tokenizer without one (e.g. a base model such as stories260K) uses this plain
fallback: each message as one line ``<role>: <content>``, then ``assistant:`` to cue the reply,
encoded with the tokenizer's special tokens (so it starts with BOS where the tokenizer adds one).
For example, a system and a user message become::

    system: You are terse.
    user: Hi!
    assistant:

Without a generation prompt the cue is left out; with `continue_final_message` the text ends
right after the final message's content (no newline), for the model to continue it. The
fallback has no variables: `chat_template_kwargs`, `documents` and `reasoning_effort` have
nothing to change there.

Roles are limited to system, user, assistant and tool, and OpenAI's developer, which newer
models take as their system prompt and templates know as "system" (vLLM passes it on as it is,
which most templates drop or refuse); any other role is a ValueError. An
assistant's tool calls reach the template as Hugging Face templates read them: each call's
arguments as an object, as vLLM passes them (OpenAI's wire format has them as JSON text), and
its reasoning as both `reasoning` and `reasoning_content`, as vLLM passes it. The fallback writes
a call as the JSON of its function, and no reasoning.

`chat_prompt` renders the text and `render_chat` encodes it: the tokenizer process measures the
text in between, since a request's kwargs (a `bos_token` the template writes) can make it far
longer than its messages.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
from jinja2 import TemplateError

from baton.chat_options import ChatOptions
from baton.checkpoint.tokenizer import Tokenizer
from baton.messages import ChatMessage
from baton.validation import RequestError

CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
# Roles rendered under another name (see the module's docstring).
ROLE_ALIASES = {"developer": "system"}
FALLBACK_REPLY_CUE = "assistant:"


@dataclass(frozen=True)
class ChatPrompt:
    """A rendered conversation: its text, and whether encoding it adds the tokenizer's special
    tokens (the fallback's BOS; a template writes its own, as transformers tokenizes it)."""

    text: str
    add_special_tokens: bool


def chat_prompt(
    tokenizer: Tokenizer, messages: Sequence[ChatMessage], options: ChatOptions | None = None
) -> ChatPrompt:
    """The prompt text of a conversation, rendered under `options` (validated ones; the
    defaults: ready for the assistant's reply).

    Raises ValueError for an empty conversation, an unsupported role or a final message the
    template cannot leave open; a template's failure (jinja2 TemplateError) propagates to the
    caller.
    """
    options = options or ChatOptions()
    if not messages:
        raise ValueError("messages is empty")
    for index, message in enumerate(messages):
        if message.role not in CHAT_ROLES:
            raise ValueError(
                f"messages[{index}].role is {message.role!r}; expected one of "
                f"{', '.join(CHAT_ROLES)}"
            )
    messages = [
        msgspec.structs.replace(m, role=ROLE_ALIASES[m.role]) if m.role in ROLE_ALIASES else m
        for m in messages
    ]
    if tokenizer.chat_template is not None:
        conversation = [_template_message(m) for m in messages]
        text = tokenizer.chat_template.render(
            conversation,
            add_generation_prompt=options.add_generation_prompt,
            continue_final_message=options.continue_final_message,
            variables=options.template_variables,
        )
        return ChatPrompt(text, add_special_tokens=False)
    text = "".join(f"{m.role}: {_fallback_content(m)}\n" for m in messages)
    if options.continue_final_message:
        text = text.removesuffix("\n")
    elif options.add_generation_prompt:
        text += FALLBACK_REPLY_CUE
    return ChatPrompt(text, add_special_tokens=True)


def request_chat_prompt(
    tokenizer: Tokenizer, messages: Sequence[ChatMessage], options: ChatOptions
) -> ChatPrompt:
    """`chat_prompt` for a request: what the conversation or the template refuses is the
    request's error (RequestError), not the server's."""
    try:
        return chat_prompt(tokenizer, messages, options)
    except (ValueError, TemplateError) as error:
        raise RequestError(f"invalid messages: {error}") from error


def _template_message(message: ChatMessage) -> dict[str, Any]:
    """A message as chat templates read it."""
    rendered: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls is not None:
        rendered["tool_calls"] = [_with_parsed_arguments(call) for call in message.tool_calls]
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    if message.reasoning is not None:  # under both names templates read (Qwen3's: the second)
        rendered["reasoning"] = rendered["reasoning_content"] = message.reasoning
    return rendered


def _with_parsed_arguments(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call  # not JSON: the template gets the text as it came
    return {**call, "function": {**function, "arguments": arguments}}


def _fallback_content(message: ChatMessage) -> str:
    calls = [call.get("function") for call in message.tool_calls or ()]
    return " ".join([message.content, *(json.dumps(call) for call in calls)]).strip()


def render_chat(
    tokenizer: Tokenizer, messages: Sequence[ChatMessage], options: ChatOptions | None = None
) -> list[int]:
    """The prompt token ids of a conversation: `chat_prompt`'s text, encoded (its errors)."""
    prompt = chat_prompt(tokenizer, messages, options)
    return tokenizer.encode(prompt.text, add_special_tokens=prompt.add_special_tokens)
