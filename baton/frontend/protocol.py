"""Request bodies of the OpenAI-compatible API, as pydantic models (OpenAI's and vLLM's names).

Models are strict (a string is never coerced into a number) and ignore unknown fields, as vLLM
does. The shape of a request is checked here (types, OpenAI's own bounds such as `n` and
`max_tokens`); the sampling ranges are `SamplingParams.validate`'s and the chat
template options `ChatOptions.validate`'s, which the frontend calls before the pipeline
(frontend/params.py), the same checks and wording a ZMQ client gets. Options that would change
the output but are not implemented (tools, a request's own chat template...) are rejected
rather than silently ignored. Responses are plain dicts built per endpoint: pydantic per
streamed chunk would cost too much.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from baton.frontend.response_format import ConstraintFields
from baton.sampling_params import MAX_LOGIT_BIAS_ENTRIES, MAX_LOGPROBS

# Each choice is a separate request in the pipeline: `n` is capped here, and choices over all
# prompts by what the scheduler admits at once (FrontendState.max_choices, frontend/params.py).
MAX_CHOICES = 128

# Integers travel as msgpack, which has no integers wider than 64 bits; no sane value is this big.
MAX_INT = 2**31 - 1
TokenId = Annotated[int, Field(ge=0, le=MAX_INT)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
PositiveInt = Annotated[int, Field(ge=1, le=MAX_INT)]
# An integer msgpack can carry; what it means is checked by SamplingParams.validate.
WireInt = Annotated[int, Field(ge=-(2**63), lt=2**63)]
LogprobCount = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]
# OpenAI's range for a logit bias; vLLM clamps values into it, as here.
MAX_LOGIT_BIAS = 100.0


class StrictModel(BaseModel):
    """Strict types, finite numbers (an infinite temperature would poison the sampler), unknown
    fields ignored."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(StrictModel):
    """`stream_options`: `include_usage` adds a last chunk with `usage` and no choices.
    vLLM's `continuous_usage_stats` (usage in every chunk) is refused, not ignored."""

    include_usage: bool = False
    continuous_usage_stats: bool = False

    @field_validator("continuous_usage_stats")
    @classmethod
    def _no_continuous_usage(cls, value: bool) -> bool:
        return _must_be(value, (False,), "continuous_usage_stats")


def _must_be(value: Any, allowed: tuple[Any, ...], what: str) -> Any:
    if value is not None and value not in allowed:
        raise ValueError(f"{what} is not supported")
    return value


class NullMeansDefault(StrictModel):
    """A request body in which an explicit null reads as the field left out, as in vLLM (whose
    request fields are optional with these defaults): clients send `"n": null`."""

    @model_validator(mode="before")
    @classmethod
    def _null_takes_the_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data


class SamplingRequest(NullMeansDefault, ConstraintFields):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Their ranges are SamplingParams.validate's (frontend/params.py calls it).
    temperature: float | None = None
    top_p: float | None = None
    top_k: WireInt | None = None
    min_p: float | None = None
    seed: WireInt | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[int, float] | None = None  # token ids as strings in JSON
    # vLLM's: the only tokens the output may hold, and words it never holds.
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[str] | None = None
    min_tokens: WireInt = 0
    include_stop_str_in_output: bool = False
    # vLLM's: each prompt token's logprob, rank and top-n, in the response's `prompt_logprobs`.
    prompt_logprobs: LogprobCount | None = None
    # vLLM's: logprob tokens as "token_id:<id>" (default: --return-tokens-as-token-ids).
    return_tokens_as_token_ids: bool | None = None
    # vLLM's: keep the prompt's last k tokens (-1: the last max_model_len).
    truncate_prompt_tokens: WireInt | None = None
    # For the server's --scheduling-policy: vLLM's `priority` (lower runs first), and Baton's
    # extension `deadline_ms` (from arrival; edf and lrs). The pipeline checks the deadline.
    priority: WireInt = 0
    deadline_ms: float | None = None
    # Baton's extension: each choice carries its request's stats (queue, prompt and decode times,
    # TTFT, tokens/s, cached tokens, preemptions), in the final chunk when streamed.
    return_stats: bool = False
    # vLLM's beam search, which Baton does not have: refused, not ignored.
    use_beam_search: bool = False
    length_penalty: float = 1.0

    @field_validator("use_beam_search")
    @classmethod
    def _no_beam_search(cls, value: bool) -> bool:
        return _must_be(value, (False,), "use_beam_search")

    @field_validator("length_penalty")
    @classmethod
    def _no_length_penalty(cls, value: float) -> float:
        return _must_be(value, (1.0,), "length_penalty other than 1 (beam search)")

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _token_id_keys(cls, value: Any) -> Any:
        """OpenAI's keys are token ids written as strings. SamplingParams.validate's bound on
        the entries is checked first, before anything walks a huge object."""
        if not isinstance(value, dict):
            return value  # pydantic says what is wrong with it
        if len(value) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"at most {MAX_LOGIT_BIAS_ENTRIES} logit_bias entries")
        for key in value:
            if not isinstance(key, str) or not key.isdecimal() or int(key) > MAX_INT:
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
        return {int(key): bias for key, bias in value.items()}

    @field_validator("logit_bias")
    @classmethod
    def _clamped_biases(cls, value: dict[int, float] | None) -> dict[int, float] | None:
        """vLLM clamps biases into OpenAI's [-100, 100]; once per request, not per choice."""
        if value is None:
            return None
        return {key: min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, bias)) for key, bias in value.items()}

    @field_validator("stop")
    @classmethod
    def _non_empty_stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if any(not stop for stop in stops):
            raise ValueError("stop strings must be non-empty")
        return value

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs_not_streamed(cls, value: int | None, info: ValidationInfo) -> int | None:
        """As vLLM: a streamed response has no place for them (0, which asks for no
        alternatives, passes, and nothing is scored)."""
        if value and info.data.get("stream"):
            raise ValueError("`prompt_logprobs` are not available when `stream=True`.")
        return value

    @field_validator("stream_options", mode="before")
    @classmethod
    def _stream_options_need_stream(cls, value: Any, info: ValidationInfo) -> Any:
        """vLLM's check: only stream options that say something (a non-empty object) need
        `stream` (declared before, so already validated)."""
        if value and not info.data.get("stream"):
            raise ValueError("Stream options can only be defined when `stream=True`.")
        return value

    @property
    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingRequest):
    """`POST /v1/completions`. `prompt` is text, token ids, or a list of either (one choice set
    per prompt)."""

    prompt: (
        str
        | Annotated[list[str], Field(min_length=1)]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1)]
    )
    echo: bool = False  # before max_tokens, which reads it
    # 0 only with `echo`: the prompt alone comes back (its logprobs too, with `logprobs`).
    max_tokens: Annotated[int, Field(ge=0, le=MAX_INT)] | None = 16
    logprobs: LogprobCount | None = None
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True
    prompt_embeds: Any = None  # vLLM's; refused, not ignored

    @field_validator("prompt_embeds")
    @classmethod
    def _no_prompt_embeds(cls, value: Any) -> Any:
        return _must_be(value, (), "prompt_embeds")

    @field_validator("max_tokens")
    @classmethod
    def _no_empty_output(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value == 0 and not info.data.get("echo"):
            raise ValueError("max_tokens must be at least 1 (or 0, with echo)")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix is not supported")
        return value

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, value: int | None) -> int | None:
        return _must_be(value, (1,), "best_of other than 1")
