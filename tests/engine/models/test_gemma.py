"""Gemma 2 and Gemma 3 (text): their config parsed (each layer's window, soft caps, the local
RoPE base), and greedy tokens as transformers' with prompts past the window, through every
attention path: the native kernels, torch's, chunked prefill, prefix-cache hits, preemption,
the overlap loop on and off."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import assert_greedy_matches_hf, hf_logits

import baton.engine.engine as engine_module
from baton import LLM, SamplingParams
from baton.checkpoint.load import load_checkpoint
from baton.checkpoint.model_config import CheckpointError, ModelConfig
from baton.engine.attention.torch_backend import TorchPagedAttention
from baton.validation import RequestError

VARIANTS = ("gemma2", "gemma3")
WINDOWS = {"gemma2": 16, "gemma3": 8}  # the tiny variants' sliding windows
# Both far past either window, the second within one chunk of it.
PROMPTS = [[(7 * j + 3) % 250 for j in range(45)], [(5 * j + 1) % 250 for j in range(19)]]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
# Gemma 2's own chat template (google/gemma-2-2b-it), which refuses a system message.
GEMMA2_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}{% if (message['role'] == 'assistant') %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)


@pytest.fixture(scope="module", params=VARIANTS)
def variant(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory: Callable[..., Path], variant: str) -> Path:
    return tiny_model_factory(variant)


def assert_matches(llm: LLM, model_dir: Path, prompts: list[list[int]]) -> None:
    for prompt, output in zip(prompts, llm.generate(prompts, GREEDY)):
        assert len(output.token_ids) == GREEDY.max_tokens
        assert_greedy_matches_hf(model_dir, prompt, output.token_ids)


def test_the_configs_are_parsed(tiny_model_factory: Callable[..., Path]) -> None:
    gemma2 = load_checkpoint(str(tiny_model_factory("gemma2"))).config
    assert gemma2.layer_windows == (16, None)  # sliding and full layers alternate
    assert (gemma2.gemma.attn_logit_softcapping, gemma2.gemma.final_logit_softcapping) == (8, 12)
    assert gemma2.attention_scale == 24**-0.5  # query_pre_attn_scalar, not head_dim
    assert gemma2.tie_word_embeddings and not gemma2.qk_norm
    assert gemma2.gemma.rope_local_base_freq is None
    gemma3 = load_checkpoint(str(tiny_model_factory("gemma3"))).config
    assert gemma3.architecture == "Gemma3ForCausalLM"
    assert gemma3.layer_windows == (8, None, 8)
    assert gemma3.qk_norm and gemma3.gemma.attn_logit_softcapping is None
    assert (gemma3.rope_theta, gemma3.rope_scaling) == (100.0, {"rope_type": "linear", "factor": 8})
    assert gemma3.gemma.rope_local_base_freq == 10000.0
    # Windowed layers do not cap the context: every position is served.
    assert gemma3.served_context_length(None) == gemma3.max_position_embeddings


HUB_GEMMA3 = {  # google/gemma-3-4b-it's text config, as the Hub writes it (no layer_types)
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "vocab_size": 262208,
    "hidden_size": 2560,
    "intermediate_size": 10240,
    "num_hidden_layers": 34,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "max_position_embeddings": 131072,
    "query_pre_attn_scalar": 256,
    "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0,
    "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
    "sliding_window": 1024,
    "sliding_window_pattern": 6,
}


def test_a_hub_config_without_layer_types_takes_transformers_pattern() -> None:
    config = ModelConfig.from_hf(HUB_GEMMA3)
    expected = tuple(None if (layer + 1) % 6 == 0 else 1024 for layer in range(34))
    assert config.layer_windows == expected
    assert config.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert config.gemma.rope_local_base_freq == 10000.0
    assert config.tie_word_embeddings  # Gemma ties its head where the config says nothing


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"use_bidirectional_attention": True}, "bidirectional attention"),
        ({"hidden_activation": "gelu"}, "unsupported hidden_activation 'gelu'"),
        ({"layer_types": ["sliding_attention"] * 3}, "layer_types must be 34"),
        ({"sliding_window": 0}, "sliding_window must be a positive integer"),
        ({"final_logit_softcapping": -1.0}, "a soft cap must be a number > 0"),
    ],
)
def test_what_is_not_computed_is_refused_in_one_line(change: dict, message: str) -> None:
    with pytest.raises(CheckpointError, match=message) as refused:
        ModelConfig.from_hf({**HUB_GEMMA3, **change})
    assert "\n" not in str(refused.value)


def test_the_reference_depends_on_the_window(
    tiny_model_factory: Callable[..., Path], variant: str
) -> None:
    """What the tests below compare against: with the window as wide as the prompt, transformers'
    logits change, so a token-identical run has computed the window."""
    windowed = hf_logits(tiny_model_factory(variant), PROMPTS[0])
    wide = hf_logits(tiny_model_factory(variant, sliding_window=1024), PROMPTS[0])
    assert not torch.allclose(windowed[-1], wide[-1], atol=1e-2)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_greedy_tokens_are_transformers_past_the_window(model_dir: Path, overlap: bool) -> None:
    """Chunks of 8 beside decode rows, over pages of 4, on the native kernels where this CPU has
    them (not the one-call decode step: Gemma's layers are not its)."""
    llm = LLM(
        str(model_dir), dtype="float32", chunk_size=8, page_size=4, disable_overlap=not overlap
    )
    assert llm.engine.max_model_len == 1024  # not the window
    assert llm.engine.decode_step is None
    assert_matches(llm, model_dir, PROMPTS)


def test_logprobs_are_of_the_soft_capped_logits(model_dir: Path) -> None:
    """The final logits' cap (Gemma 2's) changes no greedy token but every logprob: both the
    sampled tokens' and the prompt's are transformers'."""
    llm = LLM(str(model_dir), dtype="float32", chunk_size=8)
    params = SamplingParams(
        temperature=0, max_tokens=4, logprobs=1, prompt_logprobs=1, ignore_eos=True
    )
    output = llm.generate(PROMPTS[1:], params)[0]
    tokens = PROMPTS[1] + output.token_ids
    expected = torch.log_softmax(hf_logits(model_dir, tokens), dim=-1)
    for step, entry in enumerate(output.logprobs, start=len(PROMPTS[1]) - 1):
        assert entry.logprob == pytest.approx(float(expected[step, tokens[step + 1]]), abs=1e-4)
    for position, entry in enumerate(output.prompt_logprobs, start=1):  # (none for the first)
        want = float(expected[position - 1, tokens[position]])
        assert entry.logprob == pytest.approx(want, abs=1e-4)


def test_stored_bf16_weights_computed_in_float32(
    tiny_model_factory: Callable[..., Path], variant: str
) -> None:
    """bf16 weights, which the compact kernels multiply in small batches (the GeGLU products
    included), against transformers on the same weights."""
    model_dir = tiny_model_factory(variant, weights_dtype=torch.bfloat16)
    llm = LLM(str(model_dir), dtype="float32", chunk_size=8)
    assert_matches(llm, model_dir, PROMPTS)


def test_torch_attention_computes_the_window_too(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the native kernels: torch's masked blocks and decode bias."""
    monkeypatch.setattr(engine_module, "native_kernels_for", lambda isa: None)
    llm = LLM(str(model_dir), dtype="float32", chunk_size=16, page_size=4)
    assert isinstance(llm.engine.attention, TorchPagedAttention)
    assert llm.engine.attention.native is None
    assert_matches(llm, model_dir, PROMPTS)


def test_prefix_cache_hits_and_preemption_keep_the_tokens(model_dir: Path, variant: str) -> None:
    """A prompt sharing a cached prefix longer than the window attends from the cache; with few
    pages, requests wait and are preempted, then recomputed."""
    llm = LLM(str(model_dir), dtype="float32", page_size=4)
    prefix = PROMPTS[0][:40]
    assert_matches(llm, model_dir, [[*prefix, 11, 12]])
    output = llm.generate([[*prefix, 13, 14, 15]], GREEDY)[0]
    assert output.stats.cached_tokens >= 36 > WINDOWS[variant]
    assert_greedy_matches_hf(model_dir, [*prefix, 13, 14, 15], output.token_ids)
    crowded = LLM(str(model_dir), dtype="float32", page_size=4, num_pages=30, max_model_len=64)
    prompts = [[(p * 17 + 3 * j) % 250 for j in range(40)] for p in range(4)]
    assert_matches(crowded, model_dir, prompts)


def test_a_system_message_gets_what_the_template_gives(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """Gemma 2's template has no system role: a system message is the request's error (its
    template's words), a user message renders and generates."""
    source = tiny_model_factory("gemma2")
    model_dir = tmp_path / "gemma2_chat"
    model_dir.mkdir()
    for file in source.iterdir():
        (model_dir / file.name).write_bytes(file.read_bytes())
    config_file = model_dir / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "chat_template": GEMMA2_TEMPLATE}))
    llm = LLM(str(model_dir), dtype="float32")
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    with pytest.raises(RequestError, match="System role not supported"):
        llm.chat(system, GREEDY)
    output = llm.chat([{"role": "user", "content": "Hi"}], GREEDY)[0]
    assert len(output.token_ids) == GREEDY.max_tokens
