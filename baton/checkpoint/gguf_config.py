"""A Hugging Face config.json from a GGUF's metadata (llama.cpp's keys, read as llama.cpp reads
them, its defaults where the file is silent), for gguf_metadata.py's converted folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from baton.checkpoint.gemma_config import FULL, GELU_TANH, SLIDING
from baton.checkpoint.model_config import FREQ_FACTORS_ROPE, CheckpointError

GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}
# llama.cpp writes a Mixtral as a "llama" with experts (`llama.expert_count`).
GGUF_EXPERTS_OF_LLAMA = "MixtralForCausalLM"
# transformers' model types where llama.cpp's architecture names differ.
_HF_MODEL_TYPES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gemma3": "gemma3_text"}
# Metadata keys (after "<architecture>.") without which no config can be built.
REQUIRED_KEYS = (
    "block_count",
    "context_length",
    "embedding_length",
    "feed_forward_length",
    "attention.head_count",
)
# llama.cpp's tensor of RoPE frequency factors (the config's FREQ_FACTORS_ROPE scaling), and
# Phi-3's LongRoPE factors (longrope.py): the config's, not weights.
ROPE_FREQS_TENSOR = "rope_freqs.weight"
LONGROPE_TENSORS = {
    "long_factor": "rope_factors_long.weight",
    "short_factor": "rope_factors_short.weight",
}
ROPE_TENSORS = (ROPE_FREQS_TENSOR, *LONGROPE_TENSORS.values())
# What llama.cpp assumes of a Gemma file that does not say (src/models/gemma2.cpp, gemma3.cpp,
# llama-hparams.h): every how many layers one attends to all positions, Gemma 2's window, soft
# caps and local RoPE base, and the layer count of the 27B models, whose attention scales by
# hidden / heads rather than head_dim (as their query_pre_attn_scalar says).
GEMMA_GGUF_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma2": {"pattern": 2, "window": 4096, "softcaps": (50.0, 30.0), "layers_27b": 46},
    "gemma3": {"pattern": 6, "window": None, "softcaps": (None, None), "layers_27b": 62},
}
GEMMA3_LOCAL_ROPE_BASE = 10000.0
# Tokens llama.cpp ends a generation at by their text (llama-vocab.cpp), whatever the file's
# eos/eot ids say: a Gemma file names <eos> only, not the <end_of_turn> its chats end with, and a
# Phi-3 one <|endoftext|>, not <|end|>; Qwen's fill-in-the-middle pad and separators. Only where
# the file marks them control or user-defined tokens: one of ordinary text is a word.
END_OF_GENERATION_TEXTS = frozenset(
    {
        "<|eot_id|>",
        "<|eom_id|>",
        "<|im_end|>",
        "<|end|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<|end_of_text|>",
        "<EOT>",
        "</s>",
        "<|fim_pad|>",
        "<|fim_repo|>",
        "<|repo_name|>",
        "<|file_sep|>",
    }
)
# llama.cpp's token types (gguf.TokenType) that END_OF_GENERATION_TEXTS are taken from.
_SPECIAL_TOKEN_TYPES = (3, 4)  # CONTROL, USER_DEFINED


def field(reader: Any, key: str, default: Any = None) -> Any:
    """Metadata `key`'s value, or `default` where the file has none."""
    found = reader.fields.get(key)
    return default if found is None else found.contents()


def hf_config(reader: Any, gguf_file: Path) -> dict[str, Any]:
    """A Hugging Face config.json for the GGUF's model; CheckpointError for an architecture
    Baton does not run."""
    arch = field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise CheckpointError(
            f"{gguf_file}: GGUF architecture {arch!r} is not supported "
            f"(supported: {', '.join(GGUF_ARCHITECTURES)})"
        )
    missing = [f"{arch}.{key}" for key in REQUIRED_KEYS if field(reader, f"{arch}.{key}") is None]
    if missing:
        raise CheckpointError(f"{gguf_file}: GGUF metadata lacks {', '.join(missing)}")
    names = {tensor.name for tensor in reader.tensors}
    num_heads = field(reader, f"{arch}.attention.head_count")
    hidden_size = field(reader, f"{arch}.embedding_length")
    tokens = field(reader, "tokenizer.ggml.tokens") or []
    eos_ids = [field(reader, f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot", "eom")]
    eos_ids += _end_of_generation_ids(tokens, field(reader, "tokenizer.ggml.token_type"))
    experts = field(reader, f"{arch}.expert_count") or 0
    mixtral = arch == "llama" and experts > 0
    pad = field(reader, "tokenizer.ggml.padding_token_id")
    config = {
        "architectures": [GGUF_EXPERTS_OF_LLAMA if mixtral else GGUF_ARCHITECTURES[arch]],
        "model_type": "mixtral" if mixtral else _HF_MODEL_TYPES.get(arch, arch),
        "vocab_size": field(reader, f"{arch}.vocab_size") or len(tokens),
        "hidden_size": hidden_size,
        "intermediate_size": field(reader, f"{arch}.feed_forward_length"),
        "num_hidden_layers": field(reader, f"{arch}.block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": field(reader, f"{arch}.attention.head_count_kv", num_heads),
        "head_dim": field(reader, f"{arch}.attention.key_length", hidden_size // num_heads),
        "max_position_embeddings": field(reader, f"{arch}.context_length"),
        "rms_norm_eps": _decimal(field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": _decimal(field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(reader, arch, gguf_file),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_output.bias" in names or "blk.0.attn_q.bias" in names,
        "mlp_bias": "blk.0.ffn_up.bias" in names,
        "bos_token_id": field(reader, "tokenizer.ggml.bos_token_id"),
        # (Explicitly null where the file has none or one outside the vocabulary: Phi-3's config
        # class defaults to 32000.)
        "pad_token_id": pad if isinstance(pad, int) and 0 <= pad < len(tokens) else None,
        "eos_token_id": list(dict.fromkeys(i for i in eos_ids if i is not None)),
        # llama.cpp and transformers compute a GGUF in float32, whatever its storage types.
        "torch_dtype": "float32",
        **(_experts_config(reader, arch) if experts else {}),
    }
    rotary = field(reader, f"{arch}.rope.dimension_count", config["head_dim"])
    if rotary != config["head_dim"]:
        raise CheckpointError(
            f"{gguf_file}: partial rotary embeddings ({rotary} of {config['head_dim']} "
            "dimensions) are not supported"
        )
    if arch in GEMMA_GGUF_DEFAULTS:
        config.update(_gemma_config(reader, arch, config, gguf_file))
    if arch == "phi3":
        config.update(_phi3_config(reader, config))
    return config


def _end_of_generation_ids(tokens: list[str], types: list[int] | None) -> list[int]:
    """The ids of END_OF_GENERATION_TEXTS' tokens that the file marks special (every one, where
    it gives no types)."""
    return [
        index
        for index, text in enumerate(tokens)
        if text in END_OF_GENERATION_TEXTS
        and (types is None or types[index] in _SPECIAL_TOKEN_TYPES)
    ]


def _rope_scaling(reader: Any, arch: str, gguf_file: Path) -> dict[str, Any] | None:
    """The file's RoPE scaling as config.json's: llama.cpp's frequency factors (Llama 3.1+)
    or linear scaling (positions divided by the factor, which llama.cpp applies whenever the
    file gives one, under `rope.scaling.factor` or the older `rope.scale_linear`, unless the
    type says another kind); CheckpointError for another kind."""
    kind = field(reader, f"{arch}.rope.scaling.type", "none")
    factor = field(reader, f"{arch}.rope.scaling.factor")
    if factor is None:
        factor = field(reader, f"{arch}.rope.scale_linear")
    if kind in ("none", "linear") and factor not in (None, 0, 1):
        if not isinstance(factor, (int, float)) or factor <= 0:
            raise CheckpointError(f"{gguf_file}: linear RoPE scaling needs a factor > 0")
        return {"rope_type": "linear", "factor": _decimal(factor)}
    if kind == "linear":
        return None  # (a factor of 1, or none)
    if kind == "longrope" and arch == "phi3":
        return None  # (its factors are tensors: _phi3_config)
    if kind != "none":
        raise CheckpointError(f"{gguf_file}: RoPE scaling {kind!r} is not supported")
    return _rope_freq_factors(reader)


def _rope_freq_factors(reader: Any) -> dict[str, Any] | None:
    """The GGUF's RoPE frequency factors as the converted config's rope scaling, None without
    them: llama.cpp's converter stores a Llama 3.1+ model's llama3 scaling as `rope_freqs`, one
    factor per rotary frequency that divides it (1 for short wavelengths, the scaling factor for
    long ones, a blend between). Kept as the file's float32 values, so the frequencies are
    computed as llama.cpp computes them."""
    import gguf

    tensor = next((t for t in reader.tensors if t.name == ROPE_FREQS_TENSOR), None)
    if tensor is None:
        return None
    factors = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(-1)
    return {"rope_type": FREQ_FACTORS_ROPE, "factors": [float(value) for value in factors]}


def _experts_config(reader: Any, arch: str) -> dict[str, Any]:
    """A mixture of experts' config.json fields (moe_config.py reads them) from its GGUF:
    every layer routes (llama.cpp has no dense layers among sparse ones for these), and the
    top-k weights are renormalised as llama.cpp does for each architecture (Qwen3-MoE and
    Mixtral: yes, Qwen2-MoE: no; it reads no setting of the file's for it)."""
    fields: dict[str, Any] = {
        "num_experts_per_tok": field(reader, f"{arch}.expert_used_count"),
        "norm_topk_prob": arch != "qwen2moe",
    }
    if arch == "llama":
        return {**fields, "num_local_experts": field(reader, f"{arch}.expert_count")}
    return {
        **fields,
        "num_experts": field(reader, f"{arch}.expert_count"),
        "moe_intermediate_size": field(reader, f"{arch}.expert_feed_forward_length"),
        "shared_expert_intermediate_size": field(
            reader, f"{arch}.expert_shared_feed_forward_length", 0
        ),
        "decoder_sparse_step": 1,
    }


def _gemma_config(
    reader: Any, arch: str, config: dict[str, Any], gguf_file: Path
) -> dict[str, Any]:
    """What a Gemma 2 / Gemma 3 config.json adds (gemma_config.py reads it), from the file's
    keys and llama.cpp's defaults (GEMMA_GGUF_DEFAULTS): which layers are windowed (the
    `sliding_window_pattern`: every how many layers one is global, or a flag per layer), the
    window, soft caps, the attention's scalar and Gemma 3's local RoPE base (its global layers
    take the file's base and scaling; its local ones neither)."""
    defaults = GEMMA_GGUF_DEFAULTS[arch]
    layers = config["num_hidden_layers"]
    window = field(reader, f"{arch}.attention.sliding_window", defaults["window"])
    pattern = field(reader, f"{arch}.attention.sliding_window_pattern", defaults["pattern"])
    if isinstance(pattern, list):
        windowed = [bool(flag) for flag in pattern]
    else:  # (llama.cpp's set_swa_pattern: the last layer of every `pattern` is global)
        windowed = [pattern == 0 or layer % pattern < pattern - 1 for layer in range(layers)]
    if not window:
        windowed = [False] * layers  # (a Gemma 3 file without a window attends everywhere)
    if len(windowed) != layers:
        raise CheckpointError(f"{gguf_file}: sliding_window_pattern has not {layers} layers")
    attn_cap, final_cap = (
        field(reader, f"{arch}.{key}", default)
        for key, default in zip(
            ("attn_logit_softcapping", "final_logit_softcapping"), defaults["softcaps"]
        )
    )
    if arch == "gemma3":
        attn_cap = None  # (llama.cpp never soft-caps a Gemma 3's attention, whatever the file)
    big = layers == defaults["layers_27b"]
    scalar = config["hidden_size"] // config["num_attention_heads"] if big else config["head_dim"]
    local_base = field(reader, f"{arch}.rope.freq_base_swa")
    fields: dict[str, Any] = {
        "hidden_activation": GELU_TANH,
        "query_pre_attn_scalar": scalar,
        "attn_logit_softcapping": _decimal(attn_cap) if attn_cap else None,
        "final_logit_softcapping": _decimal(final_cap) if final_cap else None,
        "sliding_window": window or None,
        "layer_types": [SLIDING if flag else FULL for flag in windowed],
    }
    if arch == "gemma2":
        if local_base is not None and _decimal(local_base) != config["rope_theta"]:
            raise CheckpointError(f"{gguf_file}: Gemma 2 with its own local RoPE base")
        return fields
    full = {"rope_type": "default", **(config["rope_scaling"] or {})}
    full["rope_theta"] = config["rope_theta"]
    local = {"rope_type": "default", "rope_theta": _decimal(local_base or GEMMA3_LOCAL_ROPE_BASE)}
    return {**fields, "rope_scaling": None, "rope_parameters": {FULL: full, SLIDING: local}}


def _phi3_config(reader: Any, config: dict[str, Any]) -> dict[str, Any]:
    """What a Phi-3 config.json adds: the pretrained context and, for the 128k models, the
    LongRoPE factors, which llama.cpp's converter stores as tensors, and their attention
    factor. Its `sliding_window` is left out, as llama.cpp and transformers' GGUF loader
    leave it (llama.cpp disabled Phi-3's window): a GGUF is computed as they compute it."""
    original = field(reader, "phi3.rope.scaling.original_context_length")
    fields = {"original_max_position_embeddings": original or config["max_position_embeddings"]}
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    if not all(name in tensors for name in LONGROPE_TENSORS.values()):
        return fields
    import gguf

    scaling: dict[str, Any] = {"rope_type": "longrope"}
    for key, name in LONGROPE_TENSORS.items():
        values = gguf.quants.dequantize(tensors[name].data, tensors[name].tensor_type)
        scaling[key] = [float(value) for value in values.reshape(-1)]
    # (llama.cpp's default where the file has none is 1, not LongRoPE's own formula.)
    attention_factor = field(reader, "phi3.rope.scaling.attn_factor", 1.0)
    scaling["attention_factor"] = float(attention_factor)  # (as float32 rounds it)
    return {**fields, "rope_scaling": scaling}


def _decimal(value: float) -> float:
    """The decimal a float32 field was written from (1e-05, not 9.99999974737875e-06)."""
    return float(f"{value:.7g}")
