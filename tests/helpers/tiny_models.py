"""Tiny seeded random HF checkpoints, written with transformers' own model classes.

Every variant's logits are deliberately well separated (large init std, small vocabulary) so
that greedy decoding agrees token for token with transformers despite float32 rounding noise:
with HF's default 0.02 init, the top logits of a random model tie to within 1e-6.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from baton.checkpoint.byte_tokenizer import build_byte_tokenizer

WEIGHT_STD = 0.2
NORM_JITTER = 0.2  # norm weights are 1 + N(0, jitter): all ones would hide a misrouted norm
BIAS_STD = 0.2  # HF zero-initialises biases, which would hide a misrouted bias
# The byte-level tokenizer: 256 bytes, then <|bos|>, <|eos|>, <|pad|>.
VOCAB_SIZE = 259
BOS_ID, EOS_ID, PAD_ID = 256, 257, 258
# generation_config.json adds <|pad|> as a second stop token (as Llama 3 lists <|eot_id|> next to
# <|end_of_text|>), so tests see config.json's and generation_config.json's EOS ids merged.
EXTRA_EOS_ID = PAD_ID


@dataclass(frozen=True)
class TinyVariant:
    """One tiny architecture: its transformers classes and config keyword arguments."""

    config_class: type[PretrainedConfig]
    model_class: type[PreTrainedModel]
    config_kwargs: dict[str, Any] = field(default_factory=dict)


_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "pad_token_id": PAD_ID,
}

# The phi3_longrope variant's factor sets, one per rotary frequency (head_dim 16): seeded, the
# short ones in [1, 1.5), the long ones in [1, 16), so rotating by the wrong set changes tokens.
_FACTORS = torch.Generator().manual_seed(7)
LONGROPE_FACTORS = {
    "short_factor": [round(1 + 0.5 * float(x), 4) for x in torch.rand(8, generator=_FACTORS)],
    "long_factor": [round(1 + 15 * float(x), 4) for x in torch.rand(8, generator=_FACTORS)],
}

TINY_VARIANTS: dict[str, TinyVariant] = {
    # GQA, untied head, q/k/v/o biases, head_dim != hidden / heads, llama3 RoPE scaling whose
    # three frequency bands (kept, blended, stretched) all occur at head_dim 24.
    "llama": TinyVariant(
        LlamaConfig,
        LlamaForCausalLM,
        {
            **_COMMON,
            "head_dim": 24,
            "attention_bias": True,
            "tie_word_embeddings": False,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    # q/k/v biases (no o bias), tied embeddings.
    "qwen2": TinyVariant(
        Qwen2Config,
        Qwen2ForCausalLM,
        {**_COMMON, "tie_word_embeddings": True, "rope_parameters": {"rope_theta": 1e6}},
    ),
    # Per-head q/k RMSNorm, head_dim != hidden / heads, untied.
    "qwen3": TinyVariant(
        Qwen3Config,
        Qwen3ForCausalLM,
        {**_COMMON, "head_dim": 32, "tie_word_embeddings": False},
    ),
    # Llama's layers under Mistral's name, with a sliding window of 48 tokens (v0.1's is 4096),
    # head_dim != hidden / heads (as Mistral Nemo's).
    "mistral": TinyVariant(
        MistralConfig,
        MistralForCausalLM,
        {**_COMMON, "head_dim": 32, "sliding_window": 48, "tie_word_embeddings": False},
    ),
    # Gemma 2: sliding and full layers alternating, a window of 16 tokens (prompts run past it),
    # soft caps low enough to bite, the attention scaled by query_pre_attn_scalar (not
    # head_dim), tied embeddings.
    "gemma2": TinyVariant(
        Gemma2Config,
        Gemma2ForCausalLM,
        {
            **_COMMON,
            "head_dim": 32,
            "sliding_window": 16,
            "query_pre_attn_scalar": 24,
            "attn_logit_softcapping": 8.0,
            "final_logit_softcapping": 12.0,
        },
    ),
    # Gemma 3: q/k norms, three layers (local, global, local), a window of 8, the local layers'
    # RoPE base apart from the global ones', which are linearly scaled (as 4B and up).
    "gemma3": TinyVariant(
        Gemma3TextConfig,
        Gemma3ForCausalLM,
        {
            **_COMMON,
            "num_hidden_layers": 3,
            "head_dim": 32,
            "sliding_window": 8,
            "query_pre_attn_scalar": 40,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 100.0},
            },
        },
    ),
    # Phi-3: Llama's layers with q/k/v and gate/up fused in the checkpoint, no biases.
    "phi3": TinyVariant(Phi3Config, Phi3ForCausalLM, {**_COMMON, "tie_word_embeddings": False}),
    # Phi-3's 128k checkpoints, scaled down: LongRoPE over 32 original positions of 256.
    "phi3_longrope": TinyVariant(
        Phi3Config,
        Phi3ForCausalLM,
        {
            **_COMMON,
            "tie_word_embeddings": False,
            "max_position_embeddings": 256,
            "original_max_position_embeddings": 32,
            "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, **LONGROPE_FACTORS},
        },
    ),
    # Mixtures of experts, three layers each: Qwen3-MoE with q/k norms, 6 experts of which 2
    # a token, renormalised, layer 1 a dense MLP (mlp_only_layers); Qwen2-MoE with q/k/v biases,
    # 3 of 6 experts unnormalised and a gated shared expert, every second layer sparse
    # (decoder_sparse_step); Mixtral, 2 of 4 experts.
    "qwen3_moe": TinyVariant(
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        {
            **_COMMON,
            "num_hidden_layers": 3,
            "head_dim": 32,
            "num_experts": 6,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 48,
            "norm_topk_prob": True,
            "mlp_only_layers": [1],
        },
    ),
    "qwen2_moe": TinyVariant(
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        {
            **_COMMON,
            "num_hidden_layers": 3,
            "num_experts": 6,
            "num_experts_per_tok": 3,
            "moe_intermediate_size": 48,
            "shared_expert_intermediate_size": 80,
            "decoder_sparse_step": 2,
        },
    ),
    "mixtral": TinyVariant(
        MixtralConfig,
        MixtralForCausalLM,
        {**_COMMON, "num_hidden_layers": 3, "num_local_experts": 4, "num_experts_per_tok": 2},
    ),
}
# The architectures whose code paths differ, which per-architecture tests run over (Mistral's
# layers are Llama's: its own tests cover what differs).
CORE_VARIANTS = ("llama", "qwen2", "qwen3")


def tiny_hf_model(variant: str, seed: int = 0, **config_overrides: Any) -> PreTrainedModel:
    """A float32 transformers model of `variant` with seeded, well-separated random weights."""
    spec = TINY_VARIANTS[variant]
    # (A copy: transformers' configs fill nested RoPE dicts in place.)
    config = spec.config_class(**copy.deepcopy({**spec.config_kwargs, **config_overrides}))
    model = spec.model_class(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        # named_parameters lists a tied lm_head once, under the embedding's name.
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("bias"):
                param.copy_(noise * BIAS_STD)
            elif param.dim() == 1:
                param.copy_(1.0 + noise * NORM_JITTER)
            else:
                param.copy_(noise * WEIGHT_STD)
    return model


def write_tiny_checkpoint(
    directory: Path,
    variant: str,
    seed: int = 0,
    max_shard_size: str | None = None,
    weights_dtype: torch.dtype = torch.float32,
    **config_overrides: Any,
) -> Path:
    """Save a tiny `variant` checkpoint (weights, config, tokenizer, generation config).

    `weights_dtype=torch.bfloat16` stores bf16 weights and `"dtype": "bfloat16"` in config.json,
    as most real checkpoints do.
    """
    directory.mkdir(parents=True, exist_ok=True)
    model = tiny_hf_model(variant, seed, **config_overrides).to(weights_dtype)
    if max_shard_size is None:
        model.save_pretrained(directory)
    else:
        model.save_pretrained(directory, max_shard_size=max_shard_size)
    build_byte_tokenizer().save(Path(directory))
    generation = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=[EOS_ID, EXTRA_EOS_ID], pad_token_id=PAD_ID
    )
    generation.save_pretrained(directory)
    return directory


# A Qwen3-style thinking model's template, cut down: the reply opens with `<think>` for the model
# to reason in, unless `enable_thinking` is false, which closes an empty block in the prompt.
THINKING_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{% if message.reasoning_content %}<think>{{ message.reasoning_content }}</think>{% endif %}"
    "{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)
THINK_TAGS = ("<think>", "</think>")


def write_thinking_checkpoint(directory: Path, seed: int = 0) -> Path:
    """A tiny Qwen3 checkpoint whose vocabulary holds `<think>` and `</think>` (ids 259, 260,
    plain added tokens as in Qwen3's) and whose template opens a reasoning block."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as Backend

    write_tiny_checkpoint(directory, "qwen3", seed, vocab_size=VOCAB_SIZE + len(THINK_TAGS))
    backend = Backend.from_file(str(directory / "tokenizer.json"))
    backend.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in THINK_TAGS])
    backend.save(str(directory / "tokenizer.json"))
    config_file = directory / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = THINKING_CHAT_TEMPLATE
    config_file.write_text(json.dumps(config, indent=2))
    return directory
