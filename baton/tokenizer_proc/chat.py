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

from collections.abc import Mapping, Sequence

from transformers import PreTrainedTokenizerBase

from baton.messages import ChatMessage

CHAT_ROLES = ("system", "user", "assistant")
FALLBACK_REPLY_CUE = "assistant:"


def render_chat(tokenizer: PreTrainedTokenizerBase, messages: Sequence[ChatMessage]) -> list[int]:
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
    if tokenizer.chat_template:
        conversation = [{"role": m.role, "content": m.content} for m in messages]
        rendered = tokenizer.apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=True
        )
        return _token_ids(rendered)
    text = "".join(f"{m.role}: {m.content}\n" for m in messages) + FALLBACK_REPLY_CUE
    return tokenizer.encode(text, add_special_tokens=True)


def _token_ids(rendered: object) -> list[int]:
    """The ids of `apply_chat_template(tokenize=True)`'s result.

    transformers 4 returns a list of ids; transformers 5 returns a BatchEncoding (a mapping with
    `input_ids`).
    """
    if isinstance(rendered, Mapping):
        rendered = rendered["input_ids"]
    return [int(token) for token in rendered]  # type: ignore[union-attr]
