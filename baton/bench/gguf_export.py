"""Write a Llama, Qwen2, Qwen3, Gemma 2 or Gemma 3 checkpoint, or a Qwen2-MoE, Qwen3-MoE or
Mixtral (a benchmark shape, a test model) as GGUF, so llama.cpp serves the very same weights and
Baton's GGUF loader can be checked against them.

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

from baton.checkpoint.gemma_config import GEMMA_NORM_SHIFT
from baton.checkpoint.gguf_config import (
    GEMMA_GGUF_DEFAULTS,
    GGUF_ARCHITECTURES,
    GGUF_EXPERTS_OF_LLAMA,
    ROPE_FREQS_TENSOR,
)
from baton.checkpoint.load import load_checkpoint
from baton.checkpoint.model_config import ModelConfig
from baton.checkpoint.moe_config import MoEConfig
from baton.engine.weights.checkpoint_tensors import iter_weights
from baton.engine.weights.gguf_names import (
    STACKED_EXPERTS,
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
    """Write the checkpoint in `model_dir` (the module's architectures) to `target`: matrices
    (a mixture of experts' stacked ones too) as `tensor_type` (a GGML type name such as "Q8_0";
    default: that of `dtype`), 1-D tensors and routers in F32. `quantize(values, type)` makes
    a matrix's blocks (default: the gguf package's, which has no k-quants; llama.cpp's
    `llama-quantize` converts a written file to those)."""
    import gguf

    checkpoint = load_checkpoint(str(model_dir))
    config = checkpoint.config
    arch = _gguf_architecture(config)
    quant_name = tensor_type or _TENSOR_TYPES[dtype]
    tokenizer_json = json.loads((model_dir / "tokenizer.json").read_text())
    tokenizer = checkpoint.tokenizer
    add_bos = tokenizer.encode("a")[:1] == [tokenizer.bos_token_id]
    writer = gguf_writer(target, model_dir.name, config, quant_name, tokenizer_json, add_bos)
    quant = getattr(gguf.GGMLQuantizationType, quant_name)
    if (config.rope_scaling or {}).get("rope_type") == "llama3":  # as llama.cpp's converter
        writer.add_tensor(ROPE_FREQS_TENSOR, llama3_rope_freq_factors(config))
    experts = StackedExperts(config.moe)
    for name, tensor in iter_weights(checkpoint):
        values = tensor.to(torch.float32).numpy()
        heads = permuted_heads(name, config.num_heads, config.num_kv_heads)
        if arch == "llama" and heads:
            values = permute_rows(values, heads)  # llama.cpp's converter does the same
        if config.gemma is not None and name.endswith("norm.weight"):
            values = values + GEMMA_NORM_SHIFT  # (stored as 1 + w, as llama.cpp's converter)
        stacked = experts.add(name, values)
        if stacked is None and experts.holds(name):
            continue  # (an expert's weight, written with its layer's stack)
        gguf_name, values = stacked or (gguf_tensor_name(name, config), values)
        # Norm weights and biases stay float32, as llama.cpp's converter keeps 1-D tensors, and
        # so do a mixture of experts' routers (its converter's exception).
        if values.ndim == 1 or quant == gguf.GGMLQuantizationType.F32 or _router(gguf_name):
            shared_gate = gguf_name.endswith("ffn_gate_inp_shexp.weight")
            writer.add_tensor(gguf_name, values.reshape(-1) if shared_gate else values)
        else:
            data = (quantize or gguf.quants.quantize)(values, quant)
            writer.add_tensor(gguf_name, data, raw_dtype=quant)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


def _gguf_architecture(config: ModelConfig) -> str:
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
    shape (gguf_config.GEMMA_GGUF_DEFAULTS) and soft-caps every Gemma 2."""
    gemma, arch = config.gemma, _gguf_architecture(config)
    assert gemma is not None
    defaults = GEMMA_GGUF_DEFAULTS[arch]
    big = config.num_layers == defaults["layers_27b"]
    scalar = config.hidden_size // config.num_heads if big else config.head_dim
    if gemma.query_pre_attn_scalar != scalar:
        raise ValueError(f"llama.cpp scales this Gemma's attention by {scalar}^-1/2")
    caps = (gemma.attn_logit_softcapping, gemma.final_logit_softcapping)
    if arch == "gemma2" and None in caps:
        raise ValueError("llama.cpp soft-caps a Gemma 2's attention and final logits")
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


def _router(gguf_name: str) -> bool:
    return gguf_name.endswith(("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight"))


class StackedExperts:
    """Each layer's experts' weights, gathered as they come until a projection's are all there:
    llama.cpp stores them stacked, one [experts, out, in] tensor per projection
    (gguf_names.STACKED_EXPERTS)."""

    def __init__(self, moe: MoEConfig | None) -> None:
        self.moe = moe
        self.pending: dict[tuple[str, int], dict[int, np.ndarray]] = {}

    def holds(self, name: str) -> bool:
        """Whether `name` is an expert's weight."""
        return self.moe is not None and f".{self.moe.prefix}.experts." in name

    def add(self, name: str, values: np.ndarray) -> tuple[str, np.ndarray] | None:
        """Keep an expert's weight; the stacked tensor (llama.cpp's name, values) once the
        layer's last expert of that projection came, else None."""
        if not self.holds(name):
            return None
        layer, rest = name.removeprefix("model.layers.").split(".", 1)
        expert, projection = rest.split(".experts.", 1)[1].split(".", 1)
        role = self.moe.expert_names.index(projection.removesuffix(".weight"))
        stack = self.pending.setdefault((layer, role), {})
        stack[int(expert)] = values
        if len(stack) < self.moe.num_experts:
            return None
        del self.pending[(layer, role)]
        stacked = np.stack([stack[index] for index in range(self.moe.num_experts)])
        return f"blk.{layer}.{STACKED_EXPERTS[role]}", stacked


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

    writer = gguf.GGUFWriter(str(target), _gguf_architecture(config))
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


def cached_gguf(model_dir: Path, dtype: str, out_dir: Path) -> Path:
    """`model_dir` as GGUF in `out_dir`, written on first use."""
    target = out_dir / f"{model_dir.name}-{_TENSOR_TYPES[dtype].lower()}.gguf"
    if not target.is_file():
        out_dir.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".partial")
        export_gguf(model_dir, dtype, partial)
        partial.rename(target)  # a killed export never leaves a truncated file behind
    return target
