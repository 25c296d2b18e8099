"""Per-request sampling parameters, named and defaulted as vLLM's `SamplingParams`."""

from __future__ import annotations

import math

import msgspec

# vLLM treats temperatures below this as greedy.
GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How to sample one request. A msgspec Struct so it travels over ZMQ as it is.

    `top_k` <= 0 and `top_p` == 1 disable those filters; `temperature` 0 is greedy; `stop` may be
    given as one string; `logprobs=n` returns the chosen token's log-probability and the top-n;
    `min_tokens` keeps EOS and `stop_token_ids` from being sampled before that many outputs.
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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]

    @property
    def is_greedy(self) -> bool:
        """Greedy rows take the argmax; no randomness or filtering applies."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the first out-of-range field."""
        for name in ("temperature", "top_p", "min_p"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be >= 1, or 0 or -1 to disable it, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) exceeds max_tokens ({self.max_tokens})"
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if vocab_size is not None:
            for token_id in self.stop_token_ids or ():
                if not 0 <= token_id < vocab_size:
                    raise ValueError(f"stop_token_ids entry {token_id} is outside the vocabulary")
