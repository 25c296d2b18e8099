"""The built-in random model's weights (its config and tokenizer: checkpoint/random_model.py).

They come from a fixed-seed `torch.Generator` (the CPU generator gives the same numbers on every
machine), so every run serves exactly the same model.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from baton.checkpoint.model_config import ModelConfig

RANDOM_MODEL_SEED = 20240601
# Large enough init that logits are well separated, so greedy decoding does not flip between
# near-tied tokens on rounding noise (e.g. between batch sizes).
_WEIGHT_STD = 0.15
_NORM_JITTER = 0.1


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
