"""Mistral: Llama's layers under its own name, every layer attending over its sliding window,
token for token as transformers with prompts and outputs past the window, on the one-call native
decode step, the model's forward and torch's attention alike."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import assert_greedy_matches_hf, hf_logits
from helpers.decode_steps import CountingStep

import baton.engine.engine as engine_module
from baton import LLM, SamplingParams
from baton.checkpoint.load import load_checkpoint

WINDOW = 48  # the tiny variant's sliding window
PROMPTS = [[(7 * j + 3) % 250 for j in range(70)], [(5 * j + 1) % 250 for j in range(30)]]
GREEDY = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)


@pytest.fixture(scope="module")
def mistral_dir(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("mistral")


def test_the_config_windows_every_layer_and_serves_every_position(mistral_dir: Path) -> None:
    config = load_checkpoint(str(mistral_dir)).config
    assert config.architecture == "MistralForCausalLM"
    assert config.layer_windows == (WINDOW,) * config.num_layers
    assert config.served_context_length(None) == config.max_position_embeddings
    assert config.served_context_length(WINDOW + 1) == WINDOW + 1


def test_a_null_window_is_full_attention(tiny_model_factory: Callable[..., Path]) -> None:
    """Mistral's releases since v0.2 set no window."""
    config = load_checkpoint(str(tiny_model_factory("mistral", sliding_window=None))).config
    assert config.layer_windows == (None,) * config.num_layers


def test_the_reference_depends_on_the_window(tiny_model_factory: Callable[..., Path]) -> None:
    """With no window transformers' logits past it change: matching them computes it."""
    windowed = hf_logits(tiny_model_factory("mistral"), PROMPTS[0])
    full = hf_logits(tiny_model_factory("mistral", sliding_window=None), PROMPTS[0])
    assert torch.allclose(windowed[:WINDOW], full[:WINDOW], atol=1e-4)
    assert not torch.allclose(windowed[-1], full[-1], atol=1e-2)


@pytest.mark.parametrize("path", ["native", "eager", "torch"])
def test_greedy_tokens_are_transformers_past_the_window(
    tiny_model_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """Prompts and outputs past the window, in chunks and decode rows: decode rows on the
    native decode step (`native`: bf16 weights, which the compact kernels multiply), on the
    model's forward (`eager`, --enforce-eager), and with no native kernel at all (`torch`)."""
    weights = torch.bfloat16 if path == "native" else torch.float32
    model_dir = tiny_model_factory("mistral", weights_dtype=weights)
    if path == "torch":
        monkeypatch.setattr(engine_module, "native_kernels_for", lambda isa: None)
    llm = LLM(
        str(model_dir), dtype="float32", chunk_size=16, page_size=4, enforce_eager=path == "eager"
    )
    assert llm.engine.max_model_len == 1024  # not the window
    if path == "native":
        if llm.engine.decode_step is None:
            pytest.skip("the native decode step needs an AVX2 CPU and a C compiler")
        llm.engine.decode_step = counting = CountingStep(llm.engine.decode_step)
    else:
        assert llm.engine.decode_step is None
    for prompt, output in zip(PROMPTS, llm.generate(PROMPTS, GREEDY)):
        assert len(prompt) + len(output.token_ids) > WINDOW
        assert_greedy_matches_hf(model_dir, prompt, output.token_ids)
    if path == "native":
        assert counting.batches >= GREEDY.max_tokens - 1


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"disable_overlap": True},
        {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}},
    ],
    ids=["overlap", "no-overlap", "ngram"],
)
def test_a_long_generation_holds_a_windows_pages(mistral_dir: Path, options: dict) -> None:
    """Pages that leave every layer's window go back to the pool as a request generates: 300
    tokens hold about the window's pages (48 tokens: 12 of 4), not 78; the tokens stay
    transformers' (speculation's rejected drafts included); a prompt sharing the first one's
    cached prompt pages starts from them."""
    llm = LLM(str(mistral_dir), dtype="float32", page_size=4, **options)
    prompt = PROMPTS[1]
    params = SamplingParams(temperature=0, max_tokens=280, ignore_eos=True)
    [output] = llm.generate([prompt], params)
    assert_greedy_matches_hf(mistral_dir, prompt, output.token_ids)
    kv = llm.scheduler.kv
    # The prompt's 7 cached pages, the window's 12-13, the page being filled and the one the
    # overlap loop's next step pre-allocates.
    assert kv.peak_used_pages <= 7 + 13 + 2
    stats = llm.scheduler.aggregate_stats()
    assert stats.used_pages == 0
    [again] = llm.generate([[*prompt, 1, 2]], GREEDY)
    assert again.stats.cached_tokens == 28
    assert_greedy_matches_hf(mistral_dir, [*prompt, 1, 2], again.token_ids)
