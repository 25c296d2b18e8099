"""`--speculative-config`: vLLM's JSON object for speculative decoding, parsed and checked once."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

SpeculativeMethod = Literal["ngram", "draft_model"]
SPECULATIVE_METHODS: tuple[SpeculativeMethod, ...] = ("ngram", "draft_model")
# vLLM's default n-gram window when the config names neither end of it.
DEFAULT_PROMPT_LOOKUP = 5


@dataclass(frozen=True)
class SpeculativeConfig:
    """How drafts are proposed and how many each step verifies.

    ngram: prompt lookup, no second model: the tokens that followed the latest earlier
    occurrence of the context's last n tokens (n from `prompt_lookup_max` down to
    `prompt_lookup_min`). draft_model: a small model that shares the target's tokenizer
    (`model`, a folder or GGUF file), run autoregressively for `num_speculative_tokens` steps.
    """

    method: SpeculativeMethod
    num_speculative_tokens: int
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP
    model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative method {self.method!r} is not supported: use one of "
                f"{', '.join(SPECULATIVE_METHODS)}"
            )
        if not 1 <= self.num_speculative_tokens <= 32:
            raise ValueError(
                f"num_speculative_tokens must be in 1..32, got {self.num_speculative_tokens}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError('"method": "draft_model" and "model": PATH go together')

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """Parse `--speculative-config`; ValueError naming what is wrong."""
        try:
            fields = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"--speculative-config is not JSON: {error}") from None
        return cls.from_dict(fields)

    @classmethod
    def from_dict(cls, fields: object) -> SpeculativeConfig:
        """Build from the JSON object's fields (also `LLM(speculative_config={...})`)."""
        if not isinstance(fields, dict):
            raise ValueError("--speculative-config must be a JSON object")
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"}
        unknown = set(fields) - known - {"model"}
        if unknown:
            raise ValueError(f"--speculative-config: unknown keys {sorted(unknown)}")
        for key in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            if key in fields and (type(fields[key]) is not int):
                raise ValueError(f"--speculative-config: {key} must be an integer")
        if "model" in fields and not isinstance(fields["model"], str):
            raise ValueError("--speculative-config: model must be a path")
        if "method" not in fields or "num_speculative_tokens" not in fields:
            raise ValueError('--speculative-config needs "method" and "num_speculative_tokens"')
        lookup_max = fields.get("prompt_lookup_max")
        lookup_min = fields.get("prompt_lookup_min")
        # vLLM's rule: a missing end of the window takes the other's value, both missing 5.
        lookup_max = lookup_max or lookup_min or DEFAULT_PROMPT_LOOKUP
        lookup_min = lookup_min or lookup_max
        return cls(
            method=fields["method"],
            num_speculative_tokens=fields["num_speculative_tokens"],
            prompt_lookup_max=lookup_max,
            prompt_lookup_min=lookup_min,
            model=fields.get("model"),
        )
