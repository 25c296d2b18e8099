"""The metadata of a GGUF as llama.cpp's converter writes it for each architecture Baton exports
(gguf_export.py, random_gguf.py): shapes, RoPE, windows, soft caps, experts and the tokenizer.

llama.cpp's own `convert_hf_to_gguf.py` refuses tokenizers whose pre-tokenizer it does not know,
and the shapes carry Baton's byte-level BPE tokenizer (256 byte tokens, three special tokens,
filler words up to the model's vocabulary, no merges). That is GPT-2's byte-level scheme without
merges, so it is written as a `gpt2` vocabulary; ids a smaller tokenizer leaves unspelled become
unused `[PADn]` tokens, as the converter does for padded vocabularies. The benchmark sends
prompts as token ids, so tokenization never decides what is computed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from baton.checkpoint.gguf_config import (
    GEMMA_GGUF_DEFAULTS,
    GGUF_ARCHITECTURES,
    GGUF_EXPERTS_OF_LLAMA,
)
from baton.checkpoint.longrope import LONGROPE
from baton.checkpoint.model_config import ModelConfig
from baton.checkpoint.moe_config import MoEConfig


def gguf_writer(
    target: Path,
    name: str,
    config: ModelConfig,
    quant_name: str,
    tokenizer_json: dict[str, Any],
    add_bos: bool,
) -> Any:
    """A `gguf.GGUFWriter` to `target` holding `config`'s metadata as llama.cpp's converter
    writes it, a file type of `quant_name` (a GGML type name) and the merge-free byte-level
    tokenizer `tokenizer_json` (`gguf_vocabulary`); the tensors are the caller's."""
    import gguf

    writer = gguf.GGUFWriter(str(target), gguf_architecture(config))
    writer.add_name(name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if config.moe is not None:
        _add_experts_metadata(writer, config.moe)
    if config.gemma is not None:
        _add_gemma_metadata(writer, config)
    if config.architecture == "Phi3ForCausalLM":
        _add_phi3_metadata(writer, config)
    if (config.rope_scaling or {}).get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(config.rope_scaling["factor"])  # type: ignore[index]
    file_type = "ALL_F32" if quant_name == "F32" else f"MOSTLY_{quant_name}"
    # (The k-quant file types are mixes: "Q4_K" files are llama.cpp's Q4_K_M.)
    file_types = gguf.LlamaFileType.__members__
    writer.add_file_type(file_types.get(file_type, file_types.get(f"{file_type}_M")))
    tokens, types, merges = gguf_vocabulary(tokenizer_json, config.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    if config.bos_token_id is not None:
        writer.add_bos_token_id(config.bos_token_id)
    if config.eos_token_ids:
        writer.add_eos_token_id(config.eos_token_ids[0])
    writer.add_add_bos_token(add_bos)
    return writer


def gguf_vocabulary(
    tokenizer_json: dict, vocab_size: int
) -> tuple[list[str], list[int], list[str]]:
    """Token strings, llama.cpp token types and merges for ids 0..vocab_size-1 of a merge-free
    byte-level BPE tokenizer.json; ValueError for any other kind of tokenizer.

    llama.cpp requires a merge list and GGUF forbids empty arrays, so there is one merge that no
    text can form (merged symbols only come from merges, and it merges ids no byte sequence
    spells). Its result is in the vocabulary, as Hugging Face tokenizers require: where the
    vocabulary ends in three unused ids, the first of them; else the last id, whose token (a
    shape's filler word) is renamed to the merge of the two before it.
    """
    import gguf

    model = tokenizer_json["model"]
    if model["type"] != "BPE" or model.get("merges"):
        raise ValueError("only merge-free byte-level BPE tokenizers (Baton's shapes) are exported")
    tokens = [f"[PAD{index}]" for index in range(vocab_size)]
    types = [int(gguf.TokenType.UNUSED)] * vocab_size
    for text, index in model["vocab"].items():
        tokens[index], types[index] = text, int(gguf.TokenType.NORMAL)
    for added in tokenizer_json.get("added_tokens", []):
        kind = gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED
        tokens[added["id"]], types[added["id"]] = added["content"], int(kind)
    if types[-3:] == [int(gguf.TokenType.UNUSED)] * 3:
        tokens[-3] = tokens[-2] + tokens[-1]
        return tokens, types, [f"{tokens[-2]} {tokens[-1]}"]
    tokens[-1] = tokens[-3] + tokens[-2]
    return tokens, types, [f"{tokens[-3]} {tokens[-2]}"]


def gguf_architecture(config: ModelConfig) -> str:
    """llama.cpp's architecture name for `config`'s (a Mixtral: a "llama" with experts)."""
    if config.architecture == GGUF_EXPERTS_OF_LLAMA:
        return "llama"
    arch = {name: arch for arch, name in GGUF_ARCHITECTURES.items()}.get(config.architecture)
    if arch is None:
        covered = ", ".join([*GGUF_ARCHITECTURES.values(), GGUF_EXPERTS_OF_LLAMA])
        raise ValueError(f"GGUF export covers {covered}, not {config.architecture}")
    return arch


def _add_experts_metadata(writer: Any, moe: MoEConfig) -> None:
    """A mixture of experts' settings as llama.cpp's converter writes them; ValueError for one
    llama.cpp cannot express (it renormalises the top-k weights of a Qwen3-MoE and a Mixtral,
    not of a Qwen2-MoE, and has no dense layers among their sparse ones)."""
    if moe.dense_layers:
        raise ValueError("llama.cpp's MoE architectures route in every layer")
    if moe.normalize_top_k != (moe.shared_intermediate_size == 0):
        raise ValueError(
            "llama.cpp renormalises the top-k weights of exactly the models without a shared expert"
        )
    writer.add_expert_count(moe.num_experts)
    writer.add_expert_used_count(moe.top_k)
    writer.add_expert_feed_forward_length(moe.expert_intermediate_size)
    if moe.shared_intermediate_size:
        writer.add_expert_shared_feed_forward_length(moe.shared_intermediate_size)


def _add_gemma_metadata(writer: Any, config: ModelConfig) -> None:
    """A Gemma's settings as llama.cpp's converter writes them, and which layers are windowed
    (one flag each, which llama.cpp reads before its every-second / every-sixth default);
    ValueError for what llama.cpp cannot express: it derives the attention's scale from the
    shape (gguf_config.GEMMA_GGUF_DEFAULTS), soft-caps every Gemma 2 and no Gemma 3's
    attention."""
    gemma, arch = config.gemma, gguf_architecture(config)
    assert gemma is not None
    defaults = GEMMA_GGUF_DEFAULTS[arch]
    big = config.num_layers == defaults["layers_27b"]
    scalar = config.hidden_size // config.num_heads if big else config.head_dim
    if gemma.query_pre_attn_scalar != scalar:
        raise ValueError(f"llama.cpp scales this Gemma's attention by {scalar}^-1/2")
    caps = (gemma.attn_logit_softcapping, gemma.final_logit_softcapping)
    if arch == "gemma2" and None in caps:
        raise ValueError("llama.cpp soft-caps a Gemma 2's attention and final logits")
    if arch == "gemma3" and caps[0] is not None:
        raise ValueError("llama.cpp never soft-caps a Gemma 3's attention")
    if caps[0] is not None:
        writer.add_attn_logit_softcapping(caps[0])
    if caps[1] is not None:
        writer.add_final_logit_softcapping(caps[1])
    windows = [window for window in config.layer_windows if window is not None]
    if windows:
        writer.add_sliding_window(windows[0])
        writer.add_sliding_window_pattern([window is not None for window in config.layer_windows])
    if gemma.rope_local_base_freq is not None:
        writer.add_rope_freq_base_swa(gemma.rope_local_base_freq)


def _add_phi3_metadata(writer: Any, config: ModelConfig) -> None:
    """Phi-3's settings as llama.cpp's converter writes them: the pretrained context, the
    rotary dimensions, the window (0: none) and LongRoPE's attention factor (its factors are
    tensors)."""
    scaling = config.rope_scaling or {}
    original = scaling.get("original_max_position_embeddings", config.max_position_embeddings)
    writer.add_rope_scaling_orig_ctx_len(original)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_sliding_window(config.layer_windows[0] or 0)
    if scaling.get("rope_type") == LONGROPE:
        writer.add_rope_scaling_attn_factors(scaling["attention_factor"])
