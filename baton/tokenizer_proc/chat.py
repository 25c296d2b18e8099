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

Roles are limited to system, user and assistant; any other role is a ValueError.

`chat_prompt` renders the text and `render_chat` encodes it: the tokenizer process measures the
text in between, since a request's kwargs (a `bos_token` the template writes) can make it far
longer than its messages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from baton.chat_options import ChatOptions
from baton.checkpoint.tokenizer import Tokenizer
from baton.messages import ChatMessage

CHAT_ROLES = ("system", "user", "assistant")
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
    if tokenizer.chat_template is not None:
        conversation = [{"role": m.role, "content": m.content} for m in messages]
        text = tokenizer.chat_template.render(
            conversation,
            add_generation_prompt=options.add_generation_prompt,
            continue_final_message=options.continue_final_message,
            variables=options.template_variables,
        )
        return ChatPrompt(text, add_special_tokens=False)
    text = "".join(f"{m.role}: {m.content}\n" for m in messages)
    if options.continue_final_message:
        text = text.removesuffix("\n")
    elif options.add_generation_prompt:
        text += FALLBACK_REPLY_CUE
    return ChatPrompt(text, add_special_tokens=True)


def render_chat(
    tokenizer: Tokenizer, messages: Sequence[ChatMessage], options: ChatOptions | None = None
) -> list[int]:
    """The prompt token ids of a conversation: `chat_prompt`'s text, encoded (its errors)."""
    prompt = chat_prompt(tokenizer, messages, options)
    return tokenizer.encode(prompt.text, add_special_tokens=prompt.add_special_tokens)
