"""SamplingParams.validate: the one place every numeric parameter is checked against what the
engine can represent."""

from __future__ import annotations

import pytest

from baton.checkpoint.random_model import RANDOM_MODEL_NAME
from baton.sampling_params import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORD_CHARS,
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
    MAX_TOP_K,
    SamplingParams,
)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("temperature", 1e39, "temperature must be in"),  # inf in float32: NaN probabilities
        ("temperature", float("inf"), "temperature must be a finite number"),
        ("temperature", -0.5, "temperature must be in"),
        ("top_k", 2**63, "top_k must be in"),  # overflows the sampler's int64 tensor
        ("top_k", MAX_TOP_K + 1, "top_k must be in"),
        ("top_k", -2, "top_k must be in"),
        # 100,000 stop strings once slowed every other request tenfold.
        ("stop", ["x"] * (MAX_STOP_STRINGS + 1), f"at most {MAX_STOP_STRINGS} stop strings"),
        ("stop", "x" * (MAX_STOP_STRING_CHARS + 1), "stop strings must be at most"),
        ("stop_token_ids", [1] * (MAX_STOP_TOKEN_IDS + 1), "at most"),
        # A full-vocabulary bias once cost 337 ms a step, for every request of the batch.
        ("logit_bias", dict.fromkeys(range(MAX_LOGIT_BIAS_ENTRIES + 1), 1.0), "at most"),
        ("logit_bias", {3: float("nan")}, "finite"),
        ("logit_bias", {512: 1.0}, "outside the vocabulary"),
        ("presence_penalty", 2.5, "presence_penalty must be in"),
        ("frequency_penalty", -2.5, "frequency_penalty must be in"),
        ("repetition_penalty", 0.0, "greater than zero"),
        ("repetition_penalty", float("nan"), "finite"),
        ("allowed_token_ids", [], "1 to"),  # nothing could be sampled
        ("allowed_token_ids", [3, 512], "outside the vocabulary"),
        ("allowed_token_ids", [1] * (MAX_ALLOWED_TOKEN_IDS + 1), "1 to"),
        ("bad_words", [" "], "not only whitespace"),
        ("bad_words", ["x" * (MAX_BAD_WORD_CHARS + 1)], "characters"),
        ("bad_words", ["x"] * (MAX_BAD_WORDS + 1), f"at most {MAX_BAD_WORDS} bad_words"),
    ],
)
def test_unrepresentable_values_are_refused(field: str, value: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value}).validate(vocab_size=512)


def test_the_bounds_themselves_are_accepted() -> None:
    SamplingParams(
        temperature=MAX_TEMPERATURE,
        top_k=MAX_TOP_K,
        stop=["y" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS,
        stop_token_ids=[1] * MAX_STOP_TOKEN_IDS,
        logit_bias=dict.fromkeys(range(MAX_LOGIT_BIAS_ENTRIES // 2), 1.0),
        presence_penalty=2.0,
        frequency_penalty=-2.0,
        allowed_token_ids=[0, 511],
        bad_words=["y" * MAX_BAD_WORD_CHARS] * MAX_BAD_WORDS,
    ).validate(vocab_size=512)


def test_the_largest_accepted_values_sample_valid_tokens() -> None:
    """At the bounds the sampler still works: the limits are what it can represent."""
    from baton import LLM

    llm = LLM(RANDOM_MODEL_NAME, num_pages=16, max_model_len=256, max_running_requests=4)
    params = [
        SamplingParams(temperature=MAX_TEMPERATURE, max_tokens=8, ignore_eos=True, seed=1),
        SamplingParams(temperature=1.0, top_k=MAX_TOP_K, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=MAX_TEMPERATURE, top_k=MAX_TOP_K, min_tokens=8, max_tokens=8),
    ]
    for param in params:
        param.validate(vocab_size=llm.engine.vocab_size)
    outputs = llm.generate(["ab", "cd", "ef"], params)
    for output in outputs:
        assert output.finish_reason == "length" and len(output.token_ids) == 8
        assert all(0 <= token < llm.engine.vocab_size for token in output.token_ids)


@pytest.mark.parametrize(
    ("fields", "penalizes"),
    [
        ({}, False),
        ({"repetition_penalty": 1.05}, True),
        ({"frequency_penalty": -0.5}, True),
        ({"presence_penalty": 0.5}, True),
        ({"logit_bias": {3: 1.0}, "bad_words": ["x"], "allowed_token_ids": [1]}, False),
    ],
)
def test_penalizes_and_adjusts_logits(fields: dict, penalizes: bool) -> None:
    params = SamplingParams(**fields)
    assert params.penalizes is penalizes
    assert params.adjusts_logits is bool(fields)
