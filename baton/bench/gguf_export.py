"""Write a Llama, Qwen2 or Qwen3 checkpoint (a benchmark shape, a test model) as GGUF, so llama.cpp
serves the very same weights and Baton's GGUF loader can be checked against them.

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
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from baton.checkpoint.gguf_metadata import GGUF_ARCHITECTURES, ROPE_FREQS_TENSOR
from baton.checkpoint.load import load_checkpoint
from baton.checkpoint.model_config import ModelConfig
from baton.engine.weights.checkpoint_tensors import iter_weights
from baton.engine.weights.gguf_names import (
    gguf_tensor_name,
    permute_rows,
    permuted_heads,
)

_TENSOR_TYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


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


def llama3_rope_freq_factors(config: ModelConfig) -> np.ndarray:
    """Llama 3's RoPE scaling as llama.cpp's converter writes it (`rope_freqs`): per rotary
    frequency, the number it is divided by: 1 for wavelengths shorter than the original context
    over high_freq_factor, the scaling factor for those longer than it over low_freq_factor, and
    between them the reciprocal of the blend transformers applies."""
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type") != "llama3":
        raise ValueError(f"GGUF export covers llama3 RoPE scaling, not {scaling.get('rope_type')}")
    factor, old_context = scaling["factor"], scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    # In float32, frequency by frequency, as the converter computes them.
    exponents = torch.arange(0, config.head_dim, 2, dtype=torch.float32) / config.head_dim
    factors = []
    for frequency in 1.0 / (config.rope_theta**exponents):
        wavelength = 2 * math.pi / frequency
        if wavelength < old_context / high:
            factors.append(1.0)
        elif wavelength > old_context / low:
            factors.append(factor)
        else:
            smooth = (old_context / wavelength - low) / (high - low)
            factors.append(float(1 / ((1 - smooth) / factor + smooth)))
    return np.array(factors, dtype=np.float32)


def export_gguf(
    model_dir: Path,
    dtype: str,
    target: Path,
    tensor_type: str | None = None,
    quantize: Callable[[np.ndarray, Any], np.ndarray] | None = None,
) -> Path:
    """Write the Llama, Qwen2 or Qwen3 checkpoint in `model_dir` to `target`: 2-D tensors as
    `tensor_type` (a GGML type name such as "Q8_0"; default: that of `dtype`), 1-D ones in F32.
    `quantize(values, type)` makes a matrix's blocks (default: the gguf package's, which has no
    k-quants; llama.cpp's `llama-quantize` converts a written file to those)."""
    import gguf

    checkpoint = load_checkpoint(str(model_dir))
    config = checkpoint.config
    arch = {name: arch for arch, name in GGUF_ARCHITECTURES.items()}.get(config.architecture)
    if arch is None:
        raise ValueError(
            f"GGUF export covers {', '.join(GGUF_ARCHITECTURES)}, not {config.architecture}"
        )
    writer = gguf.GGUFWriter(str(target), arch)
    writer.add_name(model_dir.name)
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
    quant_name = tensor_type or _TENSOR_TYPES[dtype]
    file_type = "ALL_F32" if quant_name == "F32" else f"MOSTLY_{quant_name}"
    # (The k-quant file types are mixes: "Q4_K" files are llama.cpp's Q4_K_M.)
    file_types = gguf.LlamaFileType.__members__
    writer.add_file_type(file_types.get(file_type, file_types.get(f"{file_type}_M")))
    tokenizer_json = json.loads((model_dir / "tokenizer.json").read_text())
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
    tokenizer = checkpoint.tokenizer
    writer.add_add_bos_token(tokenizer.encode("a")[:1] == [tokenizer.bos_token_id])
    quant = getattr(gguf.GGMLQuantizationType, quant_name)
    if config.rope_scaling is not None:  # llama3 scaling, as llama.cpp's converter stores it
        writer.add_tensor(ROPE_FREQS_TENSOR, llama3_rope_freq_factors(config))
    for name, tensor in iter_weights(checkpoint):
        values = tensor.to(torch.float32).numpy()
        heads = permuted_heads(name, config.num_heads, config.num_kv_heads)
        if arch == "llama" and heads:
            values = permute_rows(values, heads)  # llama.cpp's converter does the same
        # Norm weights and biases stay float32, as llama.cpp's converter keeps 1-D tensors.
        if values.ndim == 1 or quant == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_tensor_name(name), values)
        else:
            data = (quantize or gguf.quants.quantize)(values, quant)
            writer.add_tensor(gguf_tensor_name(name), data, raw_dtype=quant)
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
