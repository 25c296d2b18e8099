"""A request's prompt, validated and tokenized for one model: a text, token ids, or a chat the
model's template renders; and, for a chat under --reasoning-parser, where its reply's reasoning
ends (tokenizer_proc/reasoning.py)."""

from __future__ import annotations

import msgspec

from baton.chat_options import ChatOptions
from baton.checkpoint.tokenizer import Tokenizer
from baton.config import SchedulingPolicy
from baton.messages import GenerateRequest
from baton.tokenizer_proc.chat import request_chat_prompt
from baton.tokenizer_proc.offload import PromptRequest
from baton.tokenizer_proc.reasoning import ReasoningTokens
from baton.validation import (
    RequestError,
    check_prompt_chars,
    truncated_prompt,
    validate_chat_options,
    validate_deadline,
    validate_params,
    validate_priority,
    validate_prompt,
)


class PromptReader:
    """Reads requests' prompts for one model and its limits; shared by the tokenizer's loop and
    its worker thread (the `tokenizers` library encodes from any thread at once)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        max_model_len: int,
        scheduling_policy: SchedulingPolicy,
        reasoning: ReasoningTokens | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.scheduling_policy = scheduling_policy
        self.reasoning = reasoning  # --reasoning-parser's tags: chats may reply in reasoning
        # A text longer than this cannot fit the context: refused before tokenizing, which for
        # a multi-megabyte prompt took seconds while every other request waited.
        self.max_prompt_chars = max_model_len * tokenizer.max_chars_per_token

    def reasoning_end(self, request: GenerateRequest, prompt_ids: list[int]) -> int | None:
        """The token that ends the reasoning a chat reply opens in; None for a reply that
        opens as content (every completion's)."""
        if self.reasoning is None or request.messages is None:
            return None
        continued = request.chat.continue_final_message
        return self.reasoning.reply_end(self.tokenizer, prompt_ids, continued)

    def validated_prompt(self, request: GenerateRequest) -> list[int]:
        """The prompt's token ids; RequestError if the request cannot be served."""
        given = [
            name
            for name in ("prompt", "prompt_token_ids", "messages")
            if getattr(request, name) is not None
        ]
        if len(given) != 1:
            found = ", ".join(given) or "none"
            raise RequestError(
                f"exactly one of prompt, prompt_token_ids and messages must be set (got {found})"
            )
        validate_params(request.params, self.vocab_size)
        validate_priority(request.priority, self.scheduling_policy)
        validate_deadline(request.deadline_ms)
        check_chat_options(request)
        prompt_ids = truncated_prompt(
            self._prompt_ids(request), request.params.truncate_prompt_tokens, self.max_model_len
        )
        validate_prompt(prompt_ids, request.params.max_tokens, self.vocab_size, self.max_model_len)
        return prompt_ids

    def _prompt_ids(self, request: GenerateRequest) -> list[int]:
        if request.prompt_token_ids is not None:
            return request.prompt_token_ids
        text, add_special_tokens = self.prompt_text(request)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def prompt_text(self, request: PromptRequest) -> tuple[str, bool]:
        """The text a prompt or chat makes, and whether to add special tokens encoding it."""
        if request.prompt is not None:
            text, add_special_tokens = request.prompt, request.add_special_tokens
        else:
            assert request.messages is not None  # exactly one prompt field is set
            chat = request_chat_prompt(self.tokenizer, request.messages, request.chat)
            text, add_special_tokens = chat.text, chat.add_special_tokens
        # The rendered text, not the messages: a kwarg the template writes (a 4 MB bos_token)
        # makes it longer. Refused before tokenizing, which for megabytes takes seconds.
        check_prompt_chars(len(text), self.max_prompt_chars, self.max_model_len)
        return text, add_special_tokens


def prompt_chars(request: PromptRequest) -> int:
    """About the characters of the prompt a request's text or messages make (0 for token
    ids), counted without rendering: what decides whether it is tokenized on the worker."""
    texts = [request.prompt] if request.prompt is not None else []
    for message in request.messages or ():
        texts += [message.content, message.reasoning or ""]
    chars = sum(len(text) for text in texts)
    if request.messages is not None:
        # The kwargs a template may write into the prompt: their encoded size (msgpack, not
        # JSON: they are not validated yet, and a ZMQ client's may hold values JSON has not).
        chars += len(msgspec.msgpack.encode(request.chat))
    return chars


def check_chat_options(request: PromptRequest) -> None:
    """RequestError for chat options without messages, or ones that cannot be honoured."""
    if request.messages is None and request.chat != ChatOptions():
        raise RequestError("chat options (`chat`) need `messages`")
    validate_chat_options(request.chat)
