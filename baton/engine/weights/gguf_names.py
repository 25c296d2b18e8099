"""Tensor names in GGUF (llama.cpp's) and in Hugging Face checkpoints, both ways, and llama.cpp's
row order of llama's q/k weights: one place for loading GGUF files and for writing them.
"""

from __future__ import annotations

import numpy as np

from baton.checkpoint.model_config import ModelConfig
from baton.engine.weights.fused_tensors import FUSED_ARCHITECTURES

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
    "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate_proj.bias": "ffn_gate.bias",
    "mlp.up_proj.bias": "ffn_up.bias",
    "mlp.down_proj.bias": "ffn_down.bias",
}
# Gemma's layers norm attention's output and the MLP's input and output: its
# `post_attention_layernorm` is not Llama's (the MLP's input, llama.cpp's `ffn_norm`).
_GEMMA_LAYER_TENSORS = {
    **_LAYER_TENSORS,
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
# Phi-3's checkpoints fuse q/k/v and gate/up, and llama.cpp's converter keeps them fused
# (weights/fused_tensors.py cuts them): gate/up always, as its `ffn_up`; q/k/v as `attn_qkv`,
# though llama.cpp reads them apart too.
_PHI3_LAYER_TENSORS = {
    **{
        hf: gguf
        for hf, gguf in _LAYER_TENSORS.items()
        if not gguf.startswith(("ffn_gate.", "ffn_up."))
    },
    "self_attn.qkv_proj.weight": "attn_qkv.weight",
    "mlp.gate_up_proj.weight": "ffn_up.weight",
}
# llama.cpp stores these of a llama (and of a Mixtral, its "llama" with experts) in
# `permute_rows` order (weights and biases alike).
LLAMA_CPP_PERMUTED = ("LlamaForCausalLM", "MixtralForCausalLM")
PERMUTED_QK = ("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")
_GLOBAL_TENSORS = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
# A mixture of experts' tensors: HF's (after "model.layers.N.<block>.", the block being
# MoEConfig.prefix: "mlp", Mixtral's "block_sparse_moe") -> llama.cpp's (after "blk.N.").
_MOE_TENSORS = {
    "gate.weight": "ffn_gate_inp.weight",
    "shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}
# llama.cpp stacks each projection of a layer's experts into one 3-D tensor ([experts, out, in]
# in numpy's order): these hold MoEConfig.expert_names' gate, up and down.
STACKED_EXPERTS = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")
# Each kind of layer's names (see `_layer_kind`), and the other way round.
_LAYER_NAMES = {"llama": _LAYER_TENSORS, "gemma": _GEMMA_LAYER_TENSORS, "phi3": _PHI3_LAYER_TENSORS}
_HF_LAYER_NAMES = {
    kind: {gguf: hf for hf, gguf in names.items()} for kind, names in _LAYER_NAMES.items()
}
_HF_GLOBAL_TENSORS = {gguf: hf for hf, gguf in _GLOBAL_TENSORS.items()}
_HF_MOE_TENSORS = {gguf: hf for hf, gguf in _MOE_TENSORS.items()}


def gguf_tensor_name(hf_name: str, config: ModelConfig | None = None) -> str:
    """llama.cpp's name for an HF tensor of a model of `config` (None: a dense Llama's; a
    mixture of experts' router and shared expert have their own, each expert's weights go into
    `STACKED_EXPERTS`); KeyError for one it has no place for."""
    if hf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[hf_name]
    model, layers, layer, rest = hf_name.split(".", 3)
    if (model, layers) != ("model", "layers"):
        raise KeyError(hf_name)
    moe = None if config is None else config.moe
    block = f"{moe.prefix}." if moe is not None else None
    if block is not None and rest.startswith(block) and rest[len(block) :] in _MOE_TENSORS:
        return f"blk.{layer}.{_MOE_TENSORS[rest[len(block) :]]}"
    return f"blk.{layer}.{_LAYER_NAMES[_layer_kind(config)][rest]}"


def _layer_kind(config: ModelConfig | None) -> str:
    """Whose layer names `config`'s architecture has: Gemma's, Phi-3's or Llama's (the rest)."""
    if config is not None and config.gemma is not None:
        return "gemma"
    if config is not None and config.architecture in FUSED_ARCHITECTURES:
        return "phi3"
    return "llama"


def hf_tensor_names(gguf_name: str, config: ModelConfig | None = None) -> list[str]:
    """The HF names of a llama.cpp tensor of a model of `config` (None: a dense Llama's): its
    one, or each expert's for a stacked tensor of a mixture of experts; KeyError for one
    Baton's models have no place for."""
    if gguf_name in _HF_GLOBAL_TENSORS:
        return [_HF_GLOBAL_TENSORS[gguf_name]]
    parts = gguf_name.split(".", 2)
    if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit():
        raise KeyError(gguf_name)
    _, layer, rest = parts
    moe = None if config is None else config.moe
    if moe is None or (rest not in _HF_MOE_TENSORS and rest not in STACKED_EXPERTS):
        return [f"model.layers.{layer}.{_HF_LAYER_NAMES[_layer_kind(config)][rest]}"]
    block = f"model.layers.{layer}.{moe.prefix}."
    if rest in _HF_MOE_TENSORS:
        return [block + _HF_MOE_TENSORS[rest]]
    role = STACKED_EXPERTS.index(rest)
    return [moe.expert_weight_names(int(layer), e)[role] for e in range(moe.num_experts)]


def permuted_heads(hf_name: str, num_heads: int, num_kv_heads: int) -> int:
    """The heads to permute a llama tensor's rows by (0: not permuted)."""
    if not hf_name.endswith(PERMUTED_QK):
        return 0
    return num_heads if ".q_proj." in hf_name else num_kv_heads


def permute_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's row order for a llama q or k weight (its converter's `permute`): each head's
    two rotary halves interleaved, rows a0 a1 ... b0 b1 ... becoming a0 b0 a1 b1 ..."""
    half = weight.shape[0] // heads // 2
    return weight.reshape(heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def unpermute_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """The inverse of `permute_rows`: HF's row order back."""
    half = weight.shape[0] // heads // 2
    return weight.reshape(heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
