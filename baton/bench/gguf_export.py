"""Write a Llama, Qwen2, Qwen3, Gemma 2, Gemma 3 or Phi-3 checkpoint, or a Qwen2-MoE, Qwen3-MoE
or Mixtral (a benchmark shape, a test model) as GGUF, so llama.cpp serves the very same weights and
Baton's GGUF loader can be checked against them.

Uses the `gguf` package (llama.cpp's own); the metadata is gguf_metadata_writer.py's.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from baton.bench.gguf_metadata_writer import gguf_architecture, gguf_writer
from baton.checkpoint.gemma_config import GEMMA_NORM_SHIFT
from baton.checkpoint.gguf_config import (
    LONGROPE_TENSORS,
    ROPE_FREQS_TENSOR,
)
from baton.checkpoint.load import load_checkpoint
from baton.checkpoint.longrope import LONGROPE
from baton.checkpoint.model_config import ModelConfig
from baton.checkpoint.moe_config import MoEConfig
from baton.engine.weights.checkpoint_tensors import iter_weights
from baton.engine.weights.fused_tensors import fused
from baton.engine.weights.gguf_names import (
    STACKED_EXPERTS,
    gguf_tensor_name,
    permute_rows,
    permuted_heads,
)

_TENSOR_TYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


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
    arch = gguf_architecture(config)
    quant_name = tensor_type or _TENSOR_TYPES[dtype]
    tokenizer_json = json.loads((model_dir / "tokenizer.json").read_text())
    tokenizer = checkpoint.tokenizer
    add_bos = tokenizer.encode("a")[:1] == [tokenizer.bos_token_id]
    writer = gguf_writer(target, model_dir.name, config, quant_name, tokenizer_json, add_bos)
    quant = getattr(gguf.GGMLQuantizationType, quant_name)
    rope_type = (config.rope_scaling or {}).get("rope_type")
    if rope_type == "llama3":  # as llama.cpp's converter
        writer.add_tensor(ROPE_FREQS_TENSOR, llama3_rope_freq_factors(config))
    if rope_type == LONGROPE:  # (Phi-3's 128k models)
        for key, tensor_name in LONGROPE_TENSORS.items():
            factors = config.rope_scaling[key]  # type: ignore[index]
            writer.add_tensor(tensor_name, np.array(factors, dtype=np.float32))
    experts = StackedExperts(config.moe)
    # (Phi-3's q/k/v and gate/up fused again, as its checkpoints and llama.cpp store them.)
    for name, tensor in fused(config, iter_weights(checkpoint)):
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


def cached_gguf(model_dir: Path, dtype: str, out_dir: Path) -> Path:
    """`model_dir` as GGUF in `out_dir`, written on first use."""
    target = out_dir / f"{model_dir.name}-{_TENSOR_TYPES[dtype].lower()}.gguf"
    if not target.is_file():
        out_dir.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".partial")
        export_gguf(model_dir, dtype, partial)
        partial.rename(target)  # a killed export never leaves a truncated file behind
    return target
