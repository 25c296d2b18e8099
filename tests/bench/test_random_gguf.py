"""Random GGUFs in real shapes (baton.bench.random_gguf), tried on a tiny shape: llama.cpp's
metadata and tensors as the loader reads them, and a model Baton serves."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
from helpers.native_cache import use_private_cache

from baton import LLM, SamplingParams
from baton.bench import random_gguf
from baton.checkpoint.load import load_checkpoint
from baton.checkpoint.model_config import ModelConfig
from baton.engine.weights.gguf_file import read_gguf_tensors

TINY = {
    **random_gguf.SHAPES["qwen3-30b-a3b"],
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
}


@pytest.fixture(autouse=True)
def private_cache(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    use_private_cache(tmp_path_factory, monkeypatch)


def test_a_random_moe_gguf_loads_as_its_shape_and_serves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(random_gguf.SHAPES, "tiny-moe", TINY)
    path = random_gguf.write_random_gguf("tiny-moe", tmp_path / "tiny-moe-Q4_0.gguf")
    config = load_checkpoint(str(path)).config
    assert config.architecture == "Qwen3MoeForCausalLM" and config.num_layers == 2
    assert (config.moe.num_experts, config.moe.top_k, config.moe.normalize_top_k) == (8, 2, True)
    assert config.moe.expert_intermediate_size == 64 and not config.tie_word_embeddings
    # Weights of mean 0 and spread about 0.02: no offset shared by every product.
    experts = next(t for t in read_gguf_tensors(path) if t.name == "blk.0.ffn_up_exps.weight")
    values = gguf.quants.dequantize(experts.data, experts.tensor_type)
    assert abs(values.mean()) < 0.02 * 0.01 and 0.015 < values.std() < 0.025
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    [output] = LLM(str(path), max_model_len=64).generate([[1, 2, 3]], params)
    assert len(output.token_ids) == 8


@pytest.mark.parametrize("shape", ["gemma-2-2b", "gemma-3-4b"])
def test_a_random_gemma_gguf_loads_as_its_shape_and_serves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shape: str
) -> None:
    """llama.cpp's Gemma names (the norms after attention and around the MLP), its pattern of
    windowed layers, the shape's soft caps and RoPE, read back as the shape's config."""
    tiny = {
        **random_gguf.SHAPES[shape],
        "vocab_size": 300,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "query_pre_attn_scalar": 32,
        "sliding_window": 8,
    }
    monkeypatch.setitem(random_gguf.SHAPES, "tiny-gemma", tiny)
    path = random_gguf.write_random_gguf("tiny-gemma", tmp_path / "tiny-gemma-Q4_0.gguf")
    config = load_checkpoint(str(path)).config
    expected = ModelConfig.from_hf(tiny)
    for setting in ("architecture", "layer_windows", "gemma", "rope_theta", "rope_scaling"):
        assert getattr(config, setting) == getattr(expected, setting), setting
    names = {tensor.name for tensor in read_gguf_tensors(path)}
    assert {"blk.5.post_attention_norm.weight", "blk.5.post_ffw_norm.weight"} <= names
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    [output] = LLM(str(path), max_model_len=64).generate([list(range(1, 20))], params)
    assert len(output.token_ids) == 8
