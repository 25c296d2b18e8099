"""The native decode step: a decode batch of a few rows runs every decoder layer in one C call.

What a captured CUDA graph is to a GPU engine, this is to the CPU one: eager PyTorch spends
5-20 us dispatching each of a layer's ~25 small ops, which at one row costs more than the
layer's arithmetic (SmolLM2, 30 layers: ~7 ms of a 20 ms step). `decode_layer.c` chains the very
kernels the model calls one by one (compact GEMV, RMSNorm, RoPE + K/V store, paged attention),
so both paths compute the same things in the same order; embedding, final norm and LM head stay
in Python (once per step). It serves decode-only batches of up to NATIVE_STEP_MAX_ROWS rows of a
float32 CPU model whose linear layers all read compact weights; everything else runs the model's
forward. `--enforce-eager` turns it off (vLLM's flag for "no CUDA graphs").
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from baton.engine.attention.metadata import AttentionMetadata
from baton.engine.compact_weights import COMPACT_MAX_ROWS
from baton.engine.kv_pool import KVPool
from baton.engine.layers import Linear
from baton.engine.model import CausalLM
from baton.engine.native.library import (
    DecoderLayerArgs,
    DecodeStepArgs,
    Matrix,
    NativeKernels,
)

# Decode batches up to this size run natively: as many rows as every linear layer multiplies
# by its compact weights (beyond, float32 GEMMs, compute-bound, overtake the compact GEMV).
NATIVE_STEP_MAX_ROWS = COMPACT_MAX_ROWS


class NativeDecodeStep:
    """Runs `CausalLM.forward` for small decode-only batches through `decode_layer.c`."""

    def __init__(self, model: CausalLM, kv_pool: KVPool, native: NativeKernels) -> None:
        self.model = model
        self.native = native
        config = model.config
        self._layers = (DecoderLayerArgs * len(model.layers))(
            *(self._layer_args(layer, kv_pool, native) for layer in model.layers)
        )
        # One scratch buffer for every layer's intermediates (decode_layer.c's DecodeStep).
        per_row = (
            2 * config.hidden_size
            + config.q_size
            + 2 * config.kv_size
            + config.q_size
            + 3 * config.intermediate_size
        )
        self._scratch = torch.empty(NATIVE_STEP_MAX_ROWS * per_row)

    @staticmethod
    def supports(model: CausalLM) -> bool:
        """Every linear layer reads compact weights and every attention runs natively."""
        linears = [module for module in model.modules() if isinstance(module, Linear)]
        return all(linear.compact is not None for linear in linears) and all(
            layer.self_attn.native is not None for layer in model.layers
        )

    def handles(self, meta: AttentionMetadata) -> bool:
        """Whether this batch runs here: decode rows only, at most NATIVE_STEP_MAX_ROWS."""
        return meta.is_decode_only and meta.batch_size <= NATIVE_STEP_MAX_ROWS

    @staticmethod
    def _layer_args(layer, kv_pool: KVPool, native: NativeKernels) -> DecoderLayerArgs:
        attn, mlp = layer.self_attn, layer.mlp
        return DecoderLayerArgs(
            Matrix.of(attn.qkv_proj.compact, attn.qkv_proj.bias),
            Matrix.of(attn.o_proj.compact, attn.o_proj.bias),
            Matrix.of(mlp.gate_up_proj.compact, mlp.gate_up_proj.bias),
            Matrix.of(mlp.down_proj.compact, mlp.down_proj.bias),
            layer.input_layernorm.weight.data_ptr(),
            layer.post_attention_layernorm.weight.data_ptr(),
            None if attn.qk_norm is None else attn.qk_norm.data_ptr(),
            kv_pool.k_cache(attn.layer).data_ptr(),
            kv_pool.v_cache(attn.layer).data_ptr(),
            attn.num_heads,
            attn.num_kv_heads,
            attn.head_dim,
            kv_pool.page_size,
            attn.eps,
            attn.scale,
        )

    @torch.inference_mode()
    def __call__(
        self, input_ids: torch.Tensor, meta: AttentionMetadata, logits_indices: torch.Tensor
    ) -> torch.Tensor:
        """Float32 logits [len(logits_indices), vocab], as `CausalLM.forward` returns them."""
        model = self.model
        hidden = F.embedding(input_ids, model.embed_tokens).contiguous()
        batch_rows = torch.arange(meta.batch_size, dtype=torch.int32)
        kv_lens = torch.tensor(meta.kv_lens, dtype=torch.int32)
        step = DecodeStepArgs(
            meta.batch_size,
            meta.positions.data_ptr(),
            meta.slot_mapping.data_ptr(),
            batch_rows.data_ptr(),
            meta.kv_indptr.data_ptr(),
            meta.kv_indices.data_ptr(),
            kv_lens.data_ptr(),
            model.rotary.cos.data_ptr(),
            model.rotary.sin.data_ptr(),
            self._scratch.data_ptr(),
        )
        self.native.decode_layers(
            self._layers, len(self._layers), ctypes.byref(step), hidden.data_ptr()
        )
        normed = self.native.rms_norm(hidden[logits_indices], model.norm.weight, model.norm.eps)
        return model.lm_head(normed)
