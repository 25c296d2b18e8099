"""The model architecture, parsed from a Hugging Face `config.json` into one typed, flat object.

Both config styles are accepted: transformers 5 writes `rope_parameters: {rope_theta, rope_type,
...}`, older checkpoints write a top-level `rope_theta` plus `rope_scaling: {rope_type|type, ...}`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from baton.checkpoint.gemma_config import (
    GEMMA_ARCHITECTURES,
    GemmaSettings,
    gemma_settings,
    global_rope_parameters,
    layer_windows,
)
from baton.checkpoint.longrope import LONGROPE_NAMES, longrope_scaling
from baton.checkpoint.moe_config import MOE_ARCHITECTURES, MoEConfig, moe_config

SUPPORTED_ARCHITECTURES = (
    *GEMMA_ARCHITECTURES,
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Phi3ForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    *MOE_ARCHITECTURES,
)
# Configs without an `architectures` list still name their family in `model_type`.
_ARCHITECTURE_BY_MODEL_TYPE = {
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
_REQUIRED_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "max_position_embeddings",
)
_LLAMA3_ROPE_KEYS = (
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
)


class CheckpointError(ValueError):
    """A checkpoint (config, weights or tokenizer) that Baton cannot load; the message says why."""


# The rope_type of a GGUF's RoPE frequency factors (llama.cpp's `rope_freqs`, each dividing its
# frequency), as the GGUF's converted config names them: Baton's own, transformers has none.
FREQ_FACTORS_ROPE = "freq_factors"


@dataclass(frozen=True)
class ModelConfig:
    """Everything the model code needs to know about a Llama / Mistral / Phi-3 / Qwen2 / Qwen3 /
    Gemma 2 / Gemma 3 checkpoint, dense or a mixture of experts (Mistral is Llama's layers with
    a sliding window, which most of its releases set to null; Phi-3 Llama's with fused
    projections; Gemma's layers are Llama's with norms after attention and the MLP as well,
    GeGLU, soft caps and windowed layers among full ones)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # None for plain RoPE; for "llama3" the dict holds factor, low_freq_factor, high_freq_factor
    # and original_max_position_embeddings, for "linear" the factor, for "longrope" both factor
    # lists (longrope.py). Excluded from hashing because dicts are unhashable.
    rope_scaling: dict[str, Any] | None = field(hash=False)
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    torch_dtype: str | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # Each layer's attention window, by the checkpoint's layer index: a query at position p sees
    # the keys at p - window + 1 .. p, `window` positions its own included, as transformers'
    # sliding_window_overlay masks them (kv_idx > q_idx - sliding_window); None: every earlier
    # position. Mistral (v0.1) and Phi-3 window every layer, Gemma its sliding_attention ones.
    layer_windows: tuple[int | None, ...]
    # Mixture of experts (Qwen2-MoE, Qwen3-MoE, Mixtral); None: a dense model.
    moe: MoEConfig | None = None
    # Gemma 2 / Gemma 3's own settings (gemma_config.py); None: another architecture.
    gemma: GemmaSettings | None = None

    def served_context_length(self, requested: int | None) -> int:
        """The context length served: `requested` (a --max-model-len), else the model's
        positions; windowed layers attend to their windows whatever the length.

        ValueError for a length past the positions the model was trained for (as vLLM refuses
        it): silently serving less than was asked hides the mistake.
        """
        positions = self.max_position_embeddings
        if requested is not None and not 1 <= requested <= positions:
            raise ValueError(
                f"--max-model-len {requested} is outside what this model supports (1 to its "
                f"{positions} positions); give at most {positions}, or leave it out"
            )
        return requested or positions

    @property
    def uniform_window(self) -> int | None:
        """The window every layer attends within (Mistral v0.1, Phi-3); None where a layer
        attends to every position (Gemma's global layers) or the windows differ."""
        windows = set(self.layer_windows)
        return windows.pop() if len(windows) == 1 else None

    @property
    def attention_scale(self) -> float:
        """What attention scores are multiplied by: 1 / sqrt(head_dim), or Gemma's
        1 / sqrt(query_pre_attn_scalar)."""
        scalar = self.head_dim if self.gemma is None else self.gemma.query_pre_attn_scalar
        return scalar**-0.5

    @property
    def q_size(self) -> int:
        """Width of the query projection (all heads)."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of the key (and of the value) projection."""
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> ModelConfig:
        """Parse a `config.json` dict; raises `CheckpointError` naming what is unsupported."""
        architecture = _architecture(config)
        missing = [key for key in _REQUIRED_KEYS if config.get(key) is None]
        if missing:
            raise CheckpointError(f"config.json lacks required key(s): {', '.join(missing)}")
        is_gemma = architecture in GEMMA_ARCHITECTURES
        hidden_act = config.get("hidden_act", "silu")
        if hidden_act != "silu" and not is_gemma:
            raise CheckpointError(f"config.json: unsupported hidden_act {hidden_act!r} (only silu)")
        if not is_gemma:
            _reject_sliding_window(config)
        sizes = {key: _positive_int(config, key) for key in _REQUIRED_KEYS}
        num_heads, hidden_size = sizes["num_attention_heads"], sizes["hidden_size"]
        num_kv_heads = _positive_int(config, "num_key_value_heads", num_heads)
        if num_heads % num_kv_heads:
            raise CheckpointError(
                f"config.json: num_attention_heads {num_heads} is not a multiple of "
                f"num_key_value_heads {num_kv_heads}"
            )
        head_dim = _positive_int(config, "head_dim", hidden_size // num_heads or None)
        rope_theta, rope_scaling = _rope(config, head_dim)
        attention_bias = bool(config.get("attention_bias", False))
        is_qwen2 = architecture in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
        try:
            moe = moe_config(architecture, config, sizes["num_hidden_layers"])
            windows = layer_windows(architecture, config, sizes["num_hidden_layers"])
            gemma = gemma_settings(architecture, config)
        except (ValueError, TypeError) as error:
            raise CheckpointError(f"config.json: {error}") from None
        return cls(
            architecture=architecture,
            vocab_size=sizes["vocab_size"],
            hidden_size=hidden_size,
            intermediate_size=sizes["intermediate_size"],
            num_layers=sizes["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=sizes["max_position_embeddings"],
            # Gemma's configs may leave it out: transformers' Gemma classes tie by default.
            tie_word_embeddings=bool(config.get("tie_word_embeddings", is_gemma)),
            # Qwen2 always has q/k/v biases and never an o_proj bias; Llama and Qwen3 put both
            # under `attention_bias`.
            qkv_bias=True if is_qwen2 else attention_bias,
            o_bias=False if is_qwen2 else attention_bias,
            mlp_bias=bool(config.get("mlp_bias", False)),
            qk_norm=architecture
            in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"),
            torch_dtype=config.get("torch_dtype") or config.get("dtype"),
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=token_id_tuple(config.get("eos_token_id")),
            layer_windows=windows,
            moe=moe,
            gemma=gemma,
        )


def _positive_int(config: dict[str, Any], key: str, default: int | None = None) -> int:
    """config[key] (or `default` where it is absent or null) as a positive integer; a
    CheckpointError naming the key otherwise (a string or a negative count once got through)."""
    value = config.get(key)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CheckpointError(f"config.json: {key} must be a positive integer, got {value!r}")
    return value


def token_id_tuple(value: int | list[int] | None) -> tuple[int, ...]:
    """Normalise an `eos_token_id` entry (absent, one id or a list of ids) to a tuple."""
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(token) for token in value)


def _architecture(config: dict[str, Any]) -> str:
    architectures = config.get("architectures") or []
    if architectures:
        name = architectures[0]
    elif config.get("model_type") in _ARCHITECTURE_BY_MODEL_TYPE:
        name = _ARCHITECTURE_BY_MODEL_TYPE[config["model_type"]]
    else:
        raise CheckpointError("config.json names no architecture (no `architectures`)")
    if name not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(SUPPORTED_ARCHITECTURES)
        raise CheckpointError(f"config.json: unsupported architecture {name!r} ({supported})")
    return name


def _reject_sliding_window(config: dict[str, Any]) -> None:
    # Qwen2/3 configs carry sliding-window fields; only full attention is implemented.
    layer_types = config.get("layer_types") or []
    if config.get("use_sliding_window") or "sliding_attention" in layer_types:
        raise CheckpointError("config.json: sliding-window attention is not supported")


def _rope(config: dict[str, Any], head_dim: int) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, the scaling or None) from either config style."""
    parameters = global_rope_parameters(config)
    theta = parameters.get("rope_theta", config.get("rope_theta", 10000.0))
    rope_type = parameters.get("rope_type", parameters.get("type", "default"))
    if parameters.get("partial_rotary_factor", 1.0) != 1.0:
        raise CheckpointError("config.json: partial rotary embeddings are not supported")
    if rope_type in (None, "default"):
        return float(theta), None
    if rope_type == FREQ_FACTORS_ROPE:
        factors = _factors(parameters, head_dim)
        return float(theta), {"rope_type": FREQ_FACTORS_ROPE, "factors": factors}
    if rope_type == "linear":  # positions divided by `factor` (Gemma 3 4B and up)
        factor = parameters.get("factor")
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0:
            raise CheckpointError("config.json: linear rope scaling needs a factor > 0")
        return float(theta), {"rope_type": "linear", "factor": float(factor)}
    if rope_type in LONGROPE_NAMES:  # Phi-3's 128k checkpoints
        try:
            return float(theta), longrope_scaling(parameters, config, head_dim)
        except ValueError as error:
            raise CheckpointError(f"config.json: {error}") from None
    if rope_type != "llama3":
        raise CheckpointError(
            f"config.json: unsupported rope_type {rope_type!r} (supported: default, linear, "
            "llama3, longrope)"
        )
    missing = [key for key in _LLAMA3_ROPE_KEYS if key not in parameters]
    if missing:
        raise CheckpointError(f"config.json: llama3 rope scaling lacks {', '.join(missing)}")
    scaling = {key: parameters[key] for key in _LLAMA3_ROPE_KEYS}
    return float(theta), {"rope_type": "llama3", **scaling}


def _factors(parameters: dict[str, Any], head_dim: int) -> list[float]:
    """A GGUF's RoPE frequency factors (gguf_metadata.py): one positive number per rotary
    frequency."""
    factors = parameters.get("factors")
    count = head_dim // 2
    if (
        not isinstance(factors, list)
        or len(factors) != count
        or not all(isinstance(f, (int, float)) and f > 0 for f in factors)
    ):
        raise CheckpointError(f"config.json: RoPE frequency factors must be {count} numbers > 0")
    return [float(factor) for factor in factors]
