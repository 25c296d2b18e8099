"""Phi-3's LongRoPE scaling (the 128k Phi-3 and Phi-3.5 checkpoints): the config's two sets of
per-frequency factors, validated, and the one set a served model rotates by.

A config names it `rope_scaling: {type: longrope, short_factor, long_factor}` beside a top-level
`original_max_position_embeddings` (Phi-3's), or transformers 5's `rope_parameters: {rope_type:
longrope, ...}`, which may hold `original_max_position_embeddings`, `factor` and
`attention_factor` as well. The meaning is transformers' (`_compute_longrope_parameters`):
inverse frequencies 1 / (factors * theta ** (2i / head_dim)), cos and sin multiplied by the
attention factor.
"""

from __future__ import annotations

import math
from typing import Any

LONGROPE = "longrope"
# Phi-3's configs once named it "su" (transformers' Phi3Config renames it too).
LONGROPE_NAMES = (LONGROPE, "su")


def longrope_scaling(
    parameters: dict[str, Any], config: dict[str, Any], head_dim: int
) -> dict[str, Any]:
    """The scaling ModelConfig keeps: both factor lists, the original context and the attention
    factor. ValueError, in one line, for what transformers could not compute with."""
    count = head_dim // 2
    short, long = (_factor_list(parameters, key, count) for key in ("short_factor", "long_factor"))
    # A top-level original_max_position_embeddings wins, as transformers gives Phi-3's priority;
    # absent both, the model's positions (so the long factors are never chosen).
    original = config.get("original_max_position_embeddings")
    if original is None:
        original = parameters.get("original_max_position_embeddings")
    if original is None:
        original = config["max_position_embeddings"]
    if isinstance(original, bool) or not isinstance(original, int) or original < 1:
        raise ValueError(
            f"longrope original_max_position_embeddings must be a positive integer, got "
            f"{original!r}"
        )
    factor = parameters.get("factor")
    if factor is None:  # Phi-3's: the ratio of its positions to the pretrained ones
        factor = config["max_position_embeddings"] / original
    elif not _positive_number(factor):
        raise ValueError(f"longrope factor must be a number > 0, got {factor!r}")
    attention_factor = parameters.get("attention_factor")
    if attention_factor is None and factor > 1.0 and original == 1:
        raise ValueError(
            "longrope original_max_position_embeddings 1 leaves the attention factor undefined "
            "(log 1 = 0): give attention_factor"
        )
    if attention_factor is None:  # the LongRoPE paper's (and transformers') default
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    elif not _positive_number(attention_factor):
        raise ValueError(
            f"longrope attention_factor must be a number > 0, got {attention_factor!r}"
        )
    return {
        "rope_type": LONGROPE,
        "short_factor": short,
        "long_factor": long,
        "original_max_position_embeddings": original,
        "attention_factor": float(attention_factor),
    }


def longrope_factor_set(scaling: dict[str, Any], context_length: int) -> tuple[str, list[float]]:
    """("long" or "short", its factors): the set a model served with `context_length` tokens
    rotates by, chosen once, at start-up, as llama.cpp chooses: the long factors where the
    served context exceeds the original one, else the short.

    transformers switches per forward call (long once a sequence passes the original context),
    but cached keys are never rotated again: switching mid-sequence would leave keys of two
    rotations in one cache, and a sequence's earlier tokens would read differently from one
    step to the next. One set for every sequence keeps every cached key consistent; a model
    served past its original context then rotates its short prompts by the long factors too.
    """
    name = "long" if context_length > scaling["original_max_position_embeddings"] else "short"
    return name, scaling[f"{name}_factor"]


def describe_longrope_choice(scaling: dict[str, Any], context_length: int) -> str:
    """One line saying which factor set a served model uses and why (logged at start-up)."""
    name, _ = longrope_factor_set(scaling, context_length)
    original = scaling["original_max_position_embeddings"]
    relation = "exceeds" if name == "long" else "is within"
    return (
        f"LongRoPE: the {name} factors, for every sequence: the served context {context_length} "
        f"{relation} the original {original} positions (attention factor "
        f"{scaling['attention_factor']:.4f})"
    )


def _factor_list(parameters: dict[str, Any], key: str, count: int) -> list[float]:
    factors = parameters.get(key)
    if (
        not isinstance(factors, list)
        or len(factors) != count
        or not all(_positive_number(factor) for factor in factors)
    ):
        raise ValueError(f"longrope {key} must be a list of {count} numbers > 0 (head_dim / 2)")
    return [float(factor) for factor in factors]


def _positive_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and value > 0
