"""Write a GGUF of random weights in a real model's shape, too big to write as an HF folder first
(a Qwen3-30B-A3B: 61 GB in bf16), straight as Q4_0 blocks, one tensor at a time; llama.cpp's
`llama-quantize --allow-requantize` then makes the mixes people download (Q4_K_M) from it.

    python -m baton.bench.random_gguf qwen3-30b-a3b /tmp/qwen3-30b-a3b-Q4_0.gguf
    llama-quantize --allow-requantize /tmp/qwen3-30b-a3b-Q4_0.gguf OUT.gguf Q4_K_M 2

Each block's scale is fixed up to its sign and its 4-bit quants uniform, so the weights have a
mean of 0 and a spread of about 0.02 (HF's initialisation); norms are ones, routers normal. The
tokenizer is Baton's byte-level one padded to the vocabulary
(gguf_metadata_writer.gguf_vocabulary): the benchmarks send token ids.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from baton.bench.gguf_metadata_writer import gguf_writer
from baton.checkpoint.byte_tokenizer import build_byte_tokenizer
from baton.checkpoint.model_config import ModelConfig
from baton.engine.weights.gguf_names import STACKED_EXPERTS, gguf_tensor_name

# config.json fields of each shape (the byte tokenizer's BOS/EOS ids: 256, 257).
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "norm_topk_prob": True,
        "bos_token_id": 256,
        "eos_token_id": 257,
    },
    # Llama-3.2-1B: issue 45's first file (tied head; no rope_freqs, as a converted folder).
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
        "bos_token_id": 256,
        "eos_token_id": 257,
    },
    # Mistral-7B-v0.3: llama.cpp writes a Mistral as a "llama" (its GGUF has no window).
    "mistral-7b": {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 32768,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "bos_token_id": 256,
        "eos_token_id": 257,
    },
    # Gemma 2 2B and Gemma 3 4B (text): windowed layers among global ones, soft caps (2),
    # linearly scaled global RoPE (3); tied heads of 256K tokens.
    "gemma-2-2b": {
        "architectures": ["Gemma2ForCausalLM"],
        "vocab_size": 256000,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "max_position_embeddings": 8192,
        "sliding_window": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "bos_token_id": 256,
        "eos_token_id": 257,
    },
    "gemma-3-4b": {
        "architectures": ["Gemma3ForCausalLM"],
        "vocab_size": 262144,
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "num_hidden_layers": 34,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "max_position_embeddings": 131072,
        "sliding_window": 1024,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "rope_local_base_freq": 10000.0,
        "bos_token_id": 256,
        "eos_token_id": 257,
    },
}
_BLOCK, _BLOCK_BYTES = 32, 18  # Q4_0: an f16 scale, then 32 4-bit quants
_SCALE = 0.0043  # uniform quants of 16 levels have a spread of about 4.6 of them: 0.02


def tensors(config: ModelConfig) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """(llama.cpp's name, numpy shape, kind) of each tensor: kind "norm", "router" or "q4_0"."""
    hidden, moe = config.hidden_size, config.moe
    yield "token_embd.weight", (config.vocab_size, hidden), "q4_0"
    yield "output_norm.weight", (hidden,), "norm"
    if not config.tie_word_embeddings:
        yield "output.weight", (config.vocab_size, hidden), "q4_0"
    norms = ["input_layernorm", "post_attention_layernorm"]
    if config.gemma is not None:
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    for layer in range(config.num_layers):
        block = f"blk.{layer}."
        for norm in norms:
            yield gguf_tensor_name(f"model.layers.{layer}.{norm}.weight", config), (hidden,), "norm"
        yield block + "attn_q.weight", (config.q_size, hidden), "q4_0"
        yield block + "attn_k.weight", (config.kv_size, hidden), "q4_0"
        yield block + "attn_v.weight", (config.kv_size, hidden), "q4_0"
        yield block + "attn_output.weight", (hidden, config.q_size), "q4_0"
        if config.qk_norm:
            yield block + "attn_q_norm.weight", (config.head_dim,), "norm"
            yield block + "attn_k_norm.weight", (config.head_dim,), "norm"
        if moe is None:
            inter = config.intermediate_size
            yield block + "ffn_gate.weight", (inter, hidden), "q4_0"
            yield block + "ffn_up.weight", (inter, hidden), "q4_0"
            yield block + "ffn_down.weight", (hidden, inter), "q4_0"
            continue
        features = moe.expert_intermediate_size
        yield block + "ffn_gate_inp.weight", (moe.num_experts, hidden), "router"
        for name in STACKED_EXPERTS:
            shape = (hidden, features) if "down" in name else (features, hidden)
            yield block + name, (moe.num_experts, *shape), "q4_0"


def random_values(shape: tuple[int, ...], kind: str, rng: np.random.Generator) -> np.ndarray:
    """A tensor's data: float32 values, or Q4_0 blocks (uint8 [..., rows, row bytes])."""
    if kind == "norm":
        return np.ones(shape, dtype=np.float32)
    if kind == "router":
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)
    *rows, in_features = shape
    blocks = rng.integers(0, 256, (*rows, in_features // _BLOCK, _BLOCK_BYTES), dtype=np.uint8)
    # Q4_0's levels are q - 8 for q in 0..15, whose mean is -1/2: scales of random signs make
    # the weights' mean 0. (One sign for all would give every product the same offset, which
    # layer after layer lines every hidden state up: every token then routes to the same
    # experts and decodes the same token.)
    signs = rng.integers(0, 2, blocks.shape[:-1], dtype=np.uint16) << 15
    scales = np.float16(_SCALE).view(np.uint16) | signs
    blocks[..., :2] = scales[..., None].view(np.uint8).reshape(*scales.shape, 2)
    return blocks.reshape(*rows, -1)


def write_random_gguf(shape: str, target: Path, seed: int = 0) -> Path:
    """Write shape `shape`'s random weights to `target`, one tensor in memory at a time."""
    import gguf

    config = ModelConfig.from_hf(SHAPES[shape])
    tokenizer = build_byte_tokenizer()
    tokenizer_json = json.loads(tokenizer.backend.to_str())
    add_bos = tokenizer.encode("a")[:1] == [tokenizer.bos_token_id]
    writer = gguf_writer(target, shape, config, "Q4_0", tokenizer_json, add_bos)
    q4_0 = gguf.GGMLQuantizationType.Q4_0
    layout = list(tensors(config))
    for name, dims, kind in layout:
        if kind == "q4_0":  # (given as the blocks' byte shape, as gguf's writer wants it)
            byte_dims = (*dims[:-1], dims[-1] // _BLOCK * _BLOCK_BYTES)
            nbytes = int(np.prod(byte_dims))
            writer.add_tensor_info(name, byte_dims, np.dtype(np.uint8), nbytes, q4_0)
        else:
            writer.add_tensor_info(name, dims, np.dtype(np.float32), int(np.prod(dims)) * 4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for _, dims, kind in layout:
        writer.write_tensor_data(random_values(dims, kind, rng))
    writer.close()
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("target", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    write_random_gguf(args.shape, args.target, args.seed)


if __name__ == "__main__":
    main()
