"""The ctypes mirrors of the C structures the native decode step reads (decode_layer.c's
Matrix, DecoderLayer, DecodeModel and DecodeStep; sampling.h's RowSampling): their fields in
the C declarations' order and types."""

from __future__ import annotations

import ctypes

import torch

from baton.engine.native.formats import FORMATS, CompactWeight

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
# linear.h's FMT_PARTS: a fused weight of parts in different formats.
PARTS_KERNEL_ID = 100


class Matrix(ctypes.Structure):
    """A compact weight, its bias, its tile-ordered copy and its panels, the compact kernel's
    vector width and the unit that multiplies bf16 tiles, as linear.h declares them."""

    _fields_ = (
        ("format", _i64),
        ("in_features", _i64),
        ("out_features", _i64),
        ("row_bytes", _i64),
        ("data", _ptr),
        ("bias", _ptr),
        ("tiles", _ptr),
        ("panels", _ptr),
        ("avx512", _i64),
        ("amx", _i64),
        ("parts", _ptr),
        ("num_parts", _i64),
    )

    @staticmethod
    def of(weight: CompactWeight, bias: torch.Tensor | None, avx512: bool, amx: bool) -> Matrix:
        """Pointers into `weight` and `bias`: the caller keeps both alive. `avx512`: the compact
        kernel may use AVX-512 (NativeKernels.avx512); `amx`: bf16 tiles are multiplied on AMX,
        else with AVX512_BF16 (NativeKernels.amx). A PARTS weight's parts are an array this
        Matrix keeps alive, each with its rows of the bias."""
        if weight.parts:
            parts, first = [], 0
            for part in weight.parts:
                rows = None if bias is None else bias[first : first + part.out_features]
                parts.append(Matrix.of(part, rows, avx512, amx))
                first += part.out_features
            array = (Matrix * len(parts))(*parts)
            matrix = Matrix(
                PARTS_KERNEL_ID,
                weight.in_features,
                weight.out_features,
                0,
                None,
                None,
                None,
                None,
                int(avx512),
                int(amx),
                ctypes.addressof(array),
                len(parts),
            )
            matrix.keep_alive = array
            return matrix
        return Matrix(
            FORMATS[weight.format].kernel_id,
            weight.in_features,
            weight.out_features,
            weight.data.stride(0),
            weight.data.data_ptr(),
            None if bias is None else bias.data_ptr(),
            None if weight.tiles is None else weight.tiles.data_ptr(),
            None if weight.panels is None else weight.panels.data_ptr(),
            int(avx512),
            int(amx),
            None,
            0,
        )


class ExpertMatrices:
    """A mixture-of-experts block's stored experts as moe_experts.c reads them: arrays of each
    expert's gate, up and down Matrix, which keep their weights alive (the C arrays point into
    them)."""

    def __init__(
        self,
        gate: list[CompactWeight],
        up: list[CompactWeight],
        down: list[CompactWeight],
        avx512: bool,
    ) -> None:
        if not gate or not len(gate) == len(up) == len(down):
            raise ValueError("every expert needs its gate, up and down weights")
        self.num_experts = len(gate)
        self.weights = (tuple(gate), tuple(up), tuple(down))
        # (The Matrix objects too: a PARTS one keeps its parts' array alive, which the arrays'
        # copies of its fields point to.)
        # (Experts hold no tiles: which unit would multiply them does not arise.)
        self.matrices = [[Matrix.of(w, None, avx512, False) for w in ws] for ws in self.weights]
        self.gate, self.up, self.down = (
            (Matrix * self.num_experts)(*matrices) for matrices in self.matrices
        )


class DecoderLayerArgs(ctypes.Structure):
    """One decoder layer's weights, caches and shape (decode_layer.c's DecoderLayer)."""

    _fields_ = (
        ("qkv", Matrix),
        ("o", Matrix),
        ("gate_up", Matrix),
        ("down", Matrix),
        ("input_norm", _ptr),
        ("post_norm", _ptr),
        ("qk_norm", _ptr),
        ("k_cache", _ptr),
        ("v_cache", _ptr),
        ("q_heads", _i64),
        ("kv_heads", _i64),
        ("head_dim", _i64),
        ("page_size", _i64),
        ("kv_type", _i64),
        ("window", _i64),  # 0: full attention
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        # A mixture of experts' layer: its float32 router and stored experts (else NULL, 0).
        ("router", _ptr),
        ("experts_gate", _ptr),
        ("experts_up", _ptr),
        ("experts_down", _ptr),
        ("num_experts", _i64),
        ("top_k", _i64),
        ("normalize_top_k", _i64),
        ("shared_gate", _ptr),  # (its shared expert's, in gate_up and down, or NULL)
        # A Gemma's layer (else NULL, 0): the norms of attention's and the MLP's outputs
        # (post_norm is then the MLP input's), GeGLU for SwiGLU, the attention logits' soft cap,
        # and this layer's RoPE tables (NULL: the step's).
        ("attn_out_norm", _ptr),
        ("mlp_out_norm", _ptr),
        ("gelu", _i64),
        ("softcap", ctypes.c_float),
        ("cos_table", _ptr),
        ("sin_table", _ptr),
    )


class DecodeModelArgs(ctypes.Structure):
    """The model around its decoder layers, and the step's buffers (decode_layer.c's
    DecodeModel)."""

    _fields_ = (
        ("embeddings", _ptr),
        ("embedding", Matrix),
        ("final_norm", _ptr),
        ("lm_head", Matrix),
        ("hidden", _ptr),
        ("normed", _ptr),
        ("logits", _ptr),
        ("eps", ctypes.c_float),
        # Gemma's embeddings' factor (1 elsewhere) and final logits' soft cap (0: none).
        ("embed_scale", ctypes.c_float),
        ("final_softcap", ctypes.c_float),
    )


class RowSampling(ctypes.Structure):
    """How the native step chooses one decode row's token, the adjustments it makes to the
    row's logits first and the raw logprobs it reports (sampling.h's RowSampling; a zero count
    or NULL pointer, the defaults, turns each off). The arrays its pointers point to must
    outlive the call that reads them."""

    _fields_ = (
        ("temperature", ctypes.c_float),
        ("top_p", ctypes.c_float),
        ("min_p", ctypes.c_float),
        ("uniform", ctypes.c_float),
        ("top_k", _i64),
        ("repetition_penalty", ctypes.c_float),
        ("frequency_penalty", ctypes.c_float),
        ("presence_penalty", ctypes.c_float),
        ("num_seen", _i64),
        ("seen_ids", _ptr),
        ("output_counts", _ptr),
        ("num_bias", _i64),
        ("bias_ids", _ptr),
        ("bias_values", _ptr),
        ("num_allowed", _i64),
        ("allowed_ids", _ptr),
        ("num_banned", _i64),
        ("banned_ids", _ptr),
        ("logprobs", _ptr),
        ("top_ids", _ptr),
        ("num_top", _i64),
        ("allowed_bits", _ptr),
    )


class DecodeStepArgs(ctypes.Structure):
    """One decode step's rows, shared by every layer (decode_layer.c's DecodeStep)."""

    _fields_ = (
        ("rows", _i64),
        ("input_ids", _ptr),
        ("tokens", _ptr),
        ("sampling", _ptr),
        ("positions", _ptr),
        ("slots", _ptr),
        ("batch_rows", _ptr),
        ("kv_indptr", _ptr),
        ("kv_indices", _ptr),
        ("kv_lens", _ptr),
        ("cos_table", _ptr),
        ("sin_table", _ptr),
        ("scratch", _ptr),
    )
