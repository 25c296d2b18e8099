"""Mistral: Llama's layers under its own name, served within its sliding window (which Baton
does not compute past), token for token as transformers; a context past the window refused in
one line."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import assert_greedy_matches_hf

from baton import LLM, SamplingParams
from baton.checkpoint.load import load_checkpoint

WINDOW = 48  # the tiny variant's sliding window


@pytest.fixture(scope="module")
def mistral_dir(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("mistral")


def test_the_config_keeps_the_window_and_serves_within_it(mistral_dir: Path) -> None:
    config = load_checkpoint(str(mistral_dir)).config
    assert config.architecture == "MistralForCausalLM"
    assert config.sliding_window == WINDOW
    assert config.served_context_length(None) == WINDOW  # not its 1024 positions
    assert config.served_context_length(WINDOW - 8) == WINDOW - 8


def test_a_context_past_the_window_is_refused_in_one_line(mistral_dir: Path) -> None:
    config = load_checkpoint(str(mistral_dir)).config
    with pytest.raises(ValueError) as refused:
        config.served_context_length(WINDOW + 1)
    message = str(refused.value)
    assert "\n" not in message
    assert message == (
        f"--max-model-len {WINDOW + 1} is past this model's sliding window of {WINDOW} tokens, "
        f"which Baton does not compute: give at most {WINDOW}"
    )


def test_a_null_window_is_full_attention(tiny_model_factory: Callable[..., Path]) -> None:
    """Mistral's releases since v0.2 set no window: the model's positions are served."""
    config = load_checkpoint(str(tiny_model_factory("mistral", sliding_window=None))).config
    assert config.sliding_window is None
    assert config.served_context_length(None) == config.max_position_embeddings


def test_greedy_tokens_are_transformers_up_to_the_window(mistral_dir: Path) -> None:
    """Prompts and outputs filling the window, in chunks and decode rows, as transformers
    (whose window masks nothing before its end)."""
    llm = LLM(str(mistral_dir), dtype="float32", chunk_size=16, page_size=4)
    assert llm.engine.max_model_len == WINDOW
    prompts = [[(7 * j + 3) % 250 for j in range(30)], [(5 * j + 1) % 250 for j in range(9)]]
    params = SamplingParams(temperature=0, max_tokens=WINDOW - 30, ignore_eos=True)
    for prompt, output in zip(prompts, llm.generate(prompts, params)):
        assert len(output.token_ids) == WINDOW - 30
        assert_greedy_matches_hf(mistral_dir, prompt, output.token_ids)
