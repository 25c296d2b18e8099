"""Whether a request can be served: the one place it is checked, with one wording (vLLM's for
the context length), for the tokenizer process and the offline `LLM` alike.

The scheduler checks only capacity (a duplicate id, a request larger than the whole KV pool, a
full queue): what depends on its state rather than on the request.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from baton.chat_options import ChatOptions
from baton.config import SchedulingPolicy
from baton.messages import ErrorCode
from baton.sampling_params import SamplingParams


class RequestError(ValueError):
    """A request that cannot be served; `code` is the wire-level error kind."""

    code: ErrorCode = "invalid_request"


class PromptTooLongError(RequestError):
    """Prompt plus requested output longer than the context, or than the whole KV pool."""

    code: ErrorCode = "prompt_too_long"


class OverloadedError(RequestError):
    """The waiting queue is full; retry later."""

    code: ErrorCode = "overloaded"


def validate_params(params: SamplingParams, vocab_size: int) -> None:
    """RequestError naming the first out-of-range sampling field."""
    try:
        params.validate(vocab_size)
    except ValueError as error:
        raise RequestError(str(error)) from error


def validate_chat_options(options: ChatOptions) -> None:
    """RequestError naming the chat option that cannot be honoured."""
    try:
        options.validate()
    except ValueError as error:
        raise RequestError(str(error)) from error


def validate_priority(priority: int, policy: SchedulingPolicy) -> None:
    """vLLM's check and wording: a priority other than 0 needs --scheduling-policy priority
    (every other policy orders requests without it)."""
    if priority != 0 and policy != "priority":
        raise RequestError(f"Got priority {priority} but Priority scheduling is not enabled.")


def truncated_prompt(
    prompt_ids: list[int], truncate_prompt_tokens: int | None, max_model_len: int
) -> list[int]:
    """The prompt as `SamplingParams.truncate_prompt_tokens` leaves it: its last k tokens (-1:
    the last max_model_len), as vLLM truncates (from the left)."""
    if truncate_prompt_tokens is None:
        return prompt_ids
    keep = max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
    return prompt_ids[-keep:]


def validate_prompt(
    prompt_ids: Sequence[int], max_tokens: int | None, vocab_size: int, max_model_len: int
) -> None:
    """RequestError for an empty prompt or an id outside the vocabulary; PromptTooLongError
    where prompt and output cannot fit the context (`max_tokens` None: until its end)."""
    if not prompt_ids:
        raise RequestError("the prompt is empty")
    check_token_ids(prompt_ids, vocab_size, "prompt_token_ids")
    check_context_length(len(prompt_ids), max_tokens, max_model_len)


def check_token_ids(token_ids: Sequence[int], vocab_size: int, name: str) -> None:
    """RequestError naming the first id (of the field `name`) outside the vocabulary."""
    for index, token in enumerate(token_ids):
        if not 0 <= token < vocab_size:
            raise RequestError(
                f"{name}[{index}] = {token} is outside the vocabulary [0, {vocab_size})"
            )


def validate_deadline(deadline_ms: float | None) -> None:
    """RequestError unless a deadline is absent or a positive, finite number of ms."""
    if deadline_ms is not None and not 0 < deadline_ms < math.inf:
        raise RequestError(
            f"deadline_ms must be a positive number of milliseconds, got {deadline_ms}"
        )


def check_context_length(prompt_len: int, max_tokens: int | None, max_model_len: int) -> None:
    """vLLM's context-length checks and wording; max_tokens=None means "until the end"."""
    limit = max_model_len
    if prompt_len >= limit:
        raise PromptTooLongError(
            f"This model's maximum context length is {limit} tokens. However, your request "
            f"has {prompt_len} input tokens. Please reduce the length of the input messages."
        )
    if max_tokens is not None and prompt_len + max_tokens > limit:
        raise PromptTooLongError(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the messages, {max_tokens} "
            "in the completion). Please reduce the length of the messages or completion."
        )


def check_prompt_chars(chars: int, max_chars: int, max_model_len: int) -> None:
    """PromptTooLongError for a text longer than any `max_model_len` tokens can spell, checked
    in time linear in its size and far below tokenizing's."""
    if chars > max_chars:
        raise PromptTooLongError(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"request has {chars} characters, more than any {max_model_len} tokens can spell. "
            "Please reduce the length of the input messages."
        )
