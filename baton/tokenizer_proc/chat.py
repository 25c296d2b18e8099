"""Chat messages -> prompt token ids.

A tokenizer with a `chat_template` renders the conversation with it (generation prompt added), as
vLLM and Hugging Face do. A tokenizer without one (e.g. a base model such as stories260K) uses this
plain fallback: each message as one line ``<role>: <content>``, then ``assistant:`` to cue the
reply, encoded with the tokenizer's special tokens (so it starts with BOS where the tokenizer adds
one). For example, a system and a user message become::

    system: You are terse.
    user: Hi!
    assistant:

Roles are limited to system, user and assistant; any other role is a ValueError.
"""

from __future__ import annotations

from collections.abc import Sequence

from baton.checkpoint.tokenizer import Tokenizer
from baton.messages import ChatMessage

CHAT_ROLES = ("system", "user", "assistant")
FALLBACK_REPLY_CUE = "assistant:"


def render_chat(tokenizer: Tokenizer, messages: Sequence[ChatMessage]) -> list[int]:
    """The prompt token ids of a conversation, ready for the assistant's reply.

    Raises ValueError for an empty conversation or an unsupported role; a template's own
    `raise_exception` (jinja2 TemplateError) propagates to the caller.
    """
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
        # The template writes the special tokens itself (as transformers tokenizes it).
        text = tokenizer.chat_template.render(conversation, add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)
    text = "".join(f"{m.role}: {m.content}\n" for m in messages) + FALLBACK_REPLY_CUE
    return tokenizer.encode(text, add_special_tokens=True)
