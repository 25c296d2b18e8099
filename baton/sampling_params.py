"""Per-request sampling parameters, named and defaulted as vLLM's `SamplingParams`."""

from __future__ import annotations

import math

import msgspec

from baton.structured_outputs import InvalidConstraint, StructuredOutputsParams

# vLLM treats temperatures below this as greedy.
GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20
# What the engine can represent: the sampler divides float32 logits by the temperature (a larger
# one becomes inf, then NaN probabilities), and top-k goes into an int64 tensor (any value past
# the vocabulary keeps every token, so int32's range is plenty).
MAX_TEMPERATURE = 3.4e38
MAX_TOP_K = 2**31 - 1
# Stop strings are matched against every new piece of text: bounded, so one request cannot slow
# the detokenizer for all (OpenAI allows 4 stop strings; these bounds are generous).
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 1024
# The sampler turns a bias into tensors every step: bounded, so one request cannot slow all.
MAX_LOGIT_BIAS_ENTRIES = 1024
# Likewise the allowed tokens, and the bad words matched against each row's output every step.
MAX_ALLOWED_TOKEN_IDS = 1 << 16
MAX_BAD_WORDS = 64
MAX_BAD_WORD_CHARS = 256
# vLLM's ranges: presence and frequency penalties in [-2, 2] (OpenAI's), repetition > 0.
MAX_PENALTY = 2.0


class InvalidSamplingParam(ValueError):
    """A sampling parameter out of range; `param` names it (OpenAI's error `param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How to sample one request. A msgspec Struct so it travels over ZMQ as it is.

    `top_k` <= 0 and `top_p` == 1 disable those filters; `temperature` 0 is greedy; `stop` may be
    given as one string; `logprobs=n` returns the chosen token's log-probability and the top-n;
    `min_tokens` keeps EOS and `stop_token_ids` from being sampled before that many outputs;
    `prompt_logprobs=n` returns each prompt token's log-probability (given the tokens before it)
    and the top-n there, as vLLM's; `truncate_prompt_tokens=k` keeps a prompt's last k tokens
    (-1: the last max_model_len), as vLLM's; `structured_outputs` constrains the output to a JSON
    schema, a regular expression, a choice or a grammar, as vLLM's.
    Penalties, `logit_bias`, `allowed_token_ids` (only these may be sampled) and `bad_words`
    (never generated) act as vLLM's (engine/sampling/logit_adjustments.py), greedy rows included.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    # vLLM's: keep the stop string, or the stop token's text, at the end of the output.
    include_stop_str_in_output: bool = False
    # vLLM's: leave special tokens (EOS, chat markers) out of the output text.
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]

    @property
    def is_greedy(self) -> bool:
        """Greedy rows take the argmax; no randomness or filtering applies."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def penalizes(self) -> bool:
        """Whether a repetition, frequency or presence penalty applies."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
        )

    @property
    def adjusts_logits(self) -> bool:
        """Whether a penalty, a bias, allowed tokens or bad words change the logits before the
        token is chosen."""
        return self.penalizes or bool(
            self.logit_bias or self.allowed_token_ids is not None or self.bad_words
        )

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise InvalidSamplingParam naming the first out-of-range field: the one check of
        these ranges, for HTTP (frontend/params.py) and ZMQ clients (baton/validation.py) alike."""
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            if not math.isfinite(getattr(self, name)):
                raise InvalidSamplingParam(name, f"{name} must be a finite number")
        if not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise InvalidSamplingParam(
                "temperature",
                f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}",
            )
        if not 0 < self.top_p <= 1:
            raise InvalidSamplingParam("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if not -1 <= self.top_k <= MAX_TOP_K:
            raise InvalidSamplingParam(
                "top_k",
                f"top_k must be in [1, {MAX_TOP_K}], or 0 or -1 to disable it, got {self.top_k}",
            )
        if not 0 <= self.min_p <= 1:
            raise InvalidSamplingParam("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                raise InvalidSamplingParam(
                    name,
                    f"{name} must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {getattr(self, name)}",
                )
        if not self.repetition_penalty > 0:
            raise InvalidSamplingParam(
                "repetition_penalty",
                f"repetition_penalty must be greater than zero, got {self.repetition_penalty}",
            )
        if len(self.logit_bias or ()) > MAX_LOGIT_BIAS_ENTRIES:
            raise InvalidSamplingParam(
                "logit_bias", f"at most {MAX_LOGIT_BIAS_ENTRIES} logit_bias entries"
            )
        if not all(math.isfinite(bias) for bias in (self.logit_bias or {}).values()):
            raise InvalidSamplingParam("logit_bias", "logit_bias values must be finite numbers")
        allowed = self.allowed_token_ids
        if allowed is not None and not 0 < len(allowed) <= MAX_ALLOWED_TOKEN_IDS:
            raise InvalidSamplingParam(
                "allowed_token_ids",
                f"allowed_token_ids must hold 1 to {MAX_ALLOWED_TOKEN_IDS} token ids",
            )
        words = self.bad_words or ()
        if len(words) > MAX_BAD_WORDS or not all(
            len(word.strip()) > 0 and len(word) <= MAX_BAD_WORD_CHARS for word in words
        ):
            raise InvalidSamplingParam(
                "bad_words",
                f"at most {MAX_BAD_WORDS} bad_words, each 1 to {MAX_BAD_WORD_CHARS} characters "
                "and not only whitespace",
            )
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidSamplingParam(
                "max_tokens", f"max_tokens must be >= 1, got {self.max_tokens}"
            )
        if self.min_tokens < 0:
            raise InvalidSamplingParam(
                "min_tokens", f"min_tokens must be >= 0, got {self.min_tokens}"
            )
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidSamplingParam(
                "min_tokens",
                f"min_tokens ({self.min_tokens}) exceeds max_tokens ({self.max_tokens})",
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidSamplingParam(
                "logprobs", f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}"
            )
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise InvalidSamplingParam(
                "prompt_logprobs",
                f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}",
            )
        truncate = self.truncate_prompt_tokens
        if truncate is not None and not (truncate == -1 or 1 <= truncate < 2**63):
            raise InvalidSamplingParam(
                "truncate_prompt_tokens",
                f"truncate_prompt_tokens must be -1 or at least 1, got {truncate}",
            )
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidSamplingParam("seed", f"seed must be in [0, 2**63), got {self.seed}")
        stops = self.stop or ()
        if len(stops) > MAX_STOP_STRINGS:
            raise InvalidSamplingParam(
                "stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}"
            )
        if any(len(stop) > MAX_STOP_STRING_CHARS for stop in stops):
            raise InvalidSamplingParam(
                "stop", f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters"
            )
        if len(self.stop_token_ids or ()) > MAX_STOP_TOKEN_IDS:
            raise InvalidSamplingParam(
                "stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids"
            )
        if self.structured_outputs is not None:
            try:
                self.structured_outputs.llguidance_grammar()
            except InvalidConstraint as error:
                raise InvalidSamplingParam("structured_outputs", str(error)) from error
        if vocab_size is not None:
            for name, token_ids in (
                ("stop_token_ids", self.stop_token_ids or ()),
                ("logit_bias", self.logit_bias or {}),
                ("allowed_token_ids", self.allowed_token_ids or ()),
            ):
                for token_id in token_ids:
                    if not 0 <= token_id < vocab_size:
                        raise InvalidSamplingParam(
                            name, f"{name} entry {token_id} is outside the vocabulary"
                        )
