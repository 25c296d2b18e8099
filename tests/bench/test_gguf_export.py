"""GGUF export of Qwen2 checkpoints for llama.cpp: names, shapes, values and the vocabulary."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from baton.bench.gguf_export import cached_gguf, llama3_rope_freq_factors
from baton.checkpoint.load import load_checkpoint
from baton.engine.models.layers import rope_inv_freq
from baton.engine.weights.checkpoint_tensors import iter_weights
from baton.engine.weights.gguf_names import gguf_tensor_name

gguf = pytest.importorskip("gguf")


def _field_value(reader, key: str):
    return reader.fields[key].contents()


def test_tensor_names_follow_llama_cpp() -> None:
    assert gguf_tensor_name("model.embed_tokens.weight") == "token_embd.weight"
    assert gguf_tensor_name("model.layers.3.self_attn.k_proj.bias") == "blk.3.attn_k.bias"
    assert gguf_tensor_name("model.layers.0.mlp.down_proj.weight") == "blk.0.ffn_down.weight"
    with pytest.raises(KeyError):
        gguf_tensor_name("model.layers.0.self_attn.rotary_emb.inv_freq")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_export_round_trips_weights_and_vocabulary(
    tmp_path: Path, tiny_model_factory: Callable[..., Path], dtype: str
) -> None:
    # A model vocabulary larger than the tokenizer's 259 ids, as in the benchmark shapes.
    model_dir = tiny_model_factory("qwen2", vocab_size=300)
    path = cached_gguf(model_dir, dtype, tmp_path)
    assert cached_gguf(model_dir, dtype, tmp_path) == path  # written once
    reader = gguf.GGUFReader(path)
    checkpoint = load_checkpoint(str(model_dir))
    config = checkpoint.config
    assert _field_value(reader, "general.architecture") == "qwen2"
    assert _field_value(reader, "qwen2.block_count") == config.num_layers
    assert _field_value(reader, "qwen2.attention.head_count_kv") == config.num_kv_heads
    assert _field_value(reader, "tokenizer.ggml.eos_token_id") == config.eos_token_ids[0]
    tokens = _field_value(reader, "tokenizer.ggml.tokens")
    types = _field_value(reader, "tokenizer.ggml.token_type")
    assert len(tokens) == len(types) == config.vocab_size
    # Byte-level BPE: id b is byte b, spelled GPT-2 style (space is "Ġ").
    assert tokens[66] == "B" and types[66] == gguf.TokenType.NORMAL
    assert tokens[32] == "Ġ"
    assert tokens[257] == "<|eos|>" and types[257] == gguf.TokenType.CONTROL
    # One merge of two unused ids into a third: no text forms it, and HF can load it.
    assert _field_value(reader, "tokenizer.ggml.merges") == ["[PAD298] [PAD299]"]
    pads = [f"[PAD{index}]" for index in range(259, 300)]
    assert tokens[258:] == ["<|pad|>", *pads[:-3], "[PAD298][PAD299]", *pads[-2:]]
    assert set(types[259:]) == {gguf.TokenType.UNUSED}

    tensors = {tensor.name: tensor for tensor in reader.tensors}
    weights = dict(iter_weights(checkpoint))
    assert len(tensors) == len(weights)
    expected_type = "BF16" if dtype == "bfloat16" else "F32"
    for hf_name, weight in weights.items():
        tensor = tensors[gguf_tensor_name(hf_name)]
        # GGUF lists dimensions innermost first.
        assert list(tensor.shape) == list(reversed(weight.shape)), hf_name
        stored = torch.from_numpy(tensor.data.copy())
        if weight.dim() == 1:
            assert tensor.tensor_type.name == "F32"
            assert torch.equal(stored.view(-1), weight.float()), hf_name
        else:
            assert tensor.tensor_type.name == expected_type
            if dtype == "bfloat16":
                stored = stored.view(torch.bfloat16)  # raw bytes -> bf16 values
            values = stored.reshape(weight.shape).float()
            assert torch.equal(values, weight.to(getattr(torch, dtype)).float()), hf_name


def test_llama3_rope_scaling_is_written_as_llama_cpp_writes_it(
    tmp_path: Path, tiny_llama_dir: Path
) -> None:
    """The tiny llama's Llama 3 RoPE scaling goes into a `rope_freqs` tensor of its own, one
    factor per rotary frequency: each frequency divided by its factor is, to float32 rounding,
    the frequency transformers' llama3 scaling gives it."""
    config = load_checkpoint(str(tiny_llama_dir)).config
    reader = gguf.GGUFReader(cached_gguf(tiny_llama_dir, "float32", tmp_path))
    [tensor] = [tensor for tensor in reader.tensors if tensor.name == "rope_freqs.weight"]
    factors = torch.from_numpy(tensor.data.copy())
    plain = rope_inv_freq(config.head_dim, config.rope_theta, None)
    scaled = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
    assert not torch.equal(plain, scaled)  # the scaling changes some frequencies
    torch.testing.assert_close(plain / factors, scaled, rtol=1e-6, atol=0)


def test_export_refuses_rope_scaling_it_cannot_write(tiny_llama_dir: Path) -> None:
    config = load_checkpoint(str(tiny_llama_dir)).config
    factors = {"rope_type": "freq_factors", "factors": [1.0] * (config.head_dim // 2)}
    with pytest.raises(ValueError, match="covers llama3 RoPE scaling, not freq_factors"):
        llama3_rope_freq_factors(dataclasses.replace(config, rope_scaling=factors))
