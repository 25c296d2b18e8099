"""Write a benchmark shape's Qwen2 checkpoint as GGUF, so llama.cpp serves the very same weights.

llama.cpp's own `convert_hf_to_gguf.py` refuses tokenizers whose pre-tokenizer it does not know,
and the shapes carry Baton's byte-level BPE tokenizer (256 byte tokens, three special tokens,
filler words up to the model's vocabulary, no merges). That is GPT-2's byte-level scheme without
merges, so it is written as a `gpt2` vocabulary; ids a smaller tokenizer leaves unspelled become
unused `[PADn]` tokens, as the converter does for padded vocabularies. The benchmark sends
prompts as token ids, so tokenization never decides what is computed. Uses the `gguf` package
(llama.cpp's own).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from baton.engine.checkpoint import load_checkpoint

_FILE_TYPES = {"float32": "ALL_F32", "bfloat16": "MOSTLY_BF16", "float16": "MOSTLY_F16"}
_TENSOR_TYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
# HF tensor name (after "model.layers.N.") -> llama.cpp's (after "blk.N.").
_LAYER_TENSORS = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GLOBAL_TENSORS = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def gguf_tensor_name(hf_name: str) -> str:
    """llama.cpp's name for an HF Qwen2 tensor; KeyError for one it has no place for."""
    if hf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[hf_name]
    model, layers, layer, rest = hf_name.split(".", 3)
    if (model, layers) != ("model", "layers"):
        raise KeyError(hf_name)
    return f"blk.{layer}.{_LAYER_TENSORS[rest]}"


def gguf_vocabulary(tokenizer_json: dict, vocab_size: int) -> tuple[list[str], list[int]]:
    """Token strings and llama.cpp token types for ids 0..vocab_size-1 of a byte-level BPE
    tokenizer.json; ValueError for any other kind of tokenizer."""
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
    return tokens, types


def export_gguf(model_dir: Path, dtype: str, target: Path) -> Path:
    """Write the Qwen2 checkpoint in `model_dir` to `target` with tensors in `dtype`."""
    import gguf

    checkpoint = load_checkpoint(str(model_dir))
    config = checkpoint.config
    if config.architecture != "Qwen2ForCausalLM" or config.qk_norm:
        raise ValueError(f"GGUF export covers Qwen2 shapes, not {config.architecture}")
    writer = gguf.GGUFWriter(str(target), "qwen2")
    writer.add_name(model_dir.name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_file_type(getattr(gguf.LlamaFileType, _FILE_TYPES[dtype]))
    tokenizer_json = json.loads((model_dir / "tokenizer.json").read_text())
    tokens, types = gguf_vocabulary(tokenizer_json, config.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    # llama.cpp requires a merge list and GGUF forbids empty arrays: one merge of the last token
    # with itself, which no text can form (merged symbols only come from merges), so
    # tokenization stays merge-free.
    writer.add_token_merges([f"{tokens[-1]} {tokens[-1]}"])
    if config.bos_token_id is not None:
        writer.add_bos_token_id(config.bos_token_id)
    if config.eos_token_ids:
        writer.add_eos_token_id(config.eos_token_ids[0])
    writer.add_add_bos_token(False)
    tensor_type = getattr(gguf.GGMLQuantizationType, _TENSOR_TYPES[dtype])
    for name, tensor in checkpoint.iter_weights():
        # Norm weights and biases stay float32, as llama.cpp's converter keeps 1-D tensors.
        values = tensor.to(torch.float32).numpy()
        if values.ndim == 1 or tensor_type == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_tensor_name(name), values)
        else:
            data = gguf.quants.quantize(values, tensor_type)
            writer.add_tensor(gguf_tensor_name(name), data, raw_dtype=tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


def cached_gguf(model_dir: Path, dtype: str, out_dir: Path) -> Path:
    """`model_dir` as GGUF in `out_dir`, written on first use."""
    target = out_dir / f"{model_dir.name}-{_TENSOR_TYPES[dtype].lower()}.gguf"
    if not target.is_file():
        out_dir.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".partial")
        export_gguf(model_dir, dtype, partial)
        partial.rename(target)  # a killed export never leaves a truncated file behind
    return target
