"""Building blocks of the decoder: linear layers, RMSNorm, rotary embeddings and the gated MLP.

Parameters are allocated uninitialised (`torch.empty`): every one is overwritten by
`CausalLM.load_weights`, and initialising multi-GB models only to overwrite them costs seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from baton.checkpoint.longrope import LONGROPE, longrope_factor_set
from baton.checkpoint.model_config import FREQ_FACTORS_ROPE
from baton.engine.native.formats import (
    COMPACT_MAX_ROWS,
    STAGED_FORMATS,
    STORED_MAX_ROWS,
    CompactWeight,
)
from baton.engine.native.library import NativeKernels

# The batch size oneDNN's packed weights are blocked for where only prefill chunks use them, by
# weight dtype. float32: SmolLM2's layers on Zen 3 (below). bf16 on AMX (the 0.5B shape's layers,
# 2 threads): blocked for 512 rows, 128-512 rows multiply at 2.0-2.3 TFLOP/s, against 1.6-2.0
# blocked for 128 and 1.5-1.6 for one row.
PREFILL_PACK_ROWS = {torch.float32: 128, torch.bfloat16: 512}


def empty_parameter(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    """An uninitialised, frozen parameter (inference only: no gradients)."""
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    """`y = x W^T (+ b)` with HF's [out_features, in_features] weight layout."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | str,
        gemm_dtype: torch.dtype | None = None,
    ) -> None:
        """`dtype` is the activations' (and the bias's); `gemm_dtype`, where given, the weight's:
        rows are cast to it for the GEMM and the result back (`ComputePlan.gemm_dtype`)."""
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.gemm_dtype = gemm_dtype
        weight_dtype = gemm_dtype or dtype
        self.weight = empty_parameter(out_features, in_features, dtype=weight_dtype, device=device)
        self.bias = empty_parameter(out_features, dtype=dtype, device=device) if bias else None
        self.packed = False
        # The weight as the checkpoint stores it, for batches of up to `compact_max_rows` rows
        # (see native/formats.py); set by CausalLM.attach_compact_weights.
        self.compact: CompactWeight | None = None
        self.compact_max_rows = COMPACT_MAX_ROWS
        self.native: NativeKernels | None = None
        # No float32 copy of the stored weight is kept (`hold_stored_only`): batches past the
        # compact kernels' rows multiply it a slab at a time (NativeKernels.stored_product);
        # with AVX-512 the staged tiles keep it up to `stored_max_rows` rows before that.
        self.stored_only = False
        self.stored_max_rows = 0

    def pack_for_cpu(self) -> None:
        """Reorder the loaded weight, once, into oneDNN's blocked layout.

        F.linear on CPU hands oneDNN the plain bf16 weight and pays a reorder on every call; a
        packed weight skips it: 1.3-3x faster at decode sizes, bit-identical results (float32
        F.linear goes to a BLAS instead, summing in another order: 2x slower, same to rounding).
        The packed weight is opaque, so this comes after loading (and after the compact weights
        are attached), and only where the compute plan packs (`ComputePlan.pack_weights`).
        """
        if self.stored_only or (self.compact is not None and self.compact.multiplies_any_rows):
            return  # no batch reaches the GEMM (see drop_gemm_weight, hold_stored_only)
        # The batch-size hint picks oneDNN's blocking. A layer with compact weights multiplies
        # its packed weight only in batches over COMPACT_MAX_ROWS rows (PANELS_MAX_ROWS with
        # panels): prefill chunks, which run 5-18 % faster at 48-160 rows blocked for
        # PREFILL_PACK_ROWS than for one row (the same at 2048; SmolLM2's layers on Zen 3). The
        # others keep the one-row blocking, which decode steps use.
        rows = PREFILL_PACK_ROWS.get(self.weight.dtype, 1) if self.compact is not None else 1
        packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), rows)
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.packed = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[tokens, in_features] -> [tokens, out_features]."""
        return self.product(x, self.bias)

    def product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """`x W^T (+ bias)`: the layer's product with the given bias (a row-parallel layer adds
        its own after the ranks' sum, models/parallel_layers.py)."""
        if self.reads_compact(x.shape[0]):
            return self.native.gemv(x, self.compact, bias)
        if self.stored_only:
            return self.native.stored_product(x, self.compact, bias)
        if self.gemm_dtype is None:
            return self._gemm(x, bias)
        out = self._gemm(x.to(self.gemm_dtype), None).to(x.dtype)
        return out if bias is None else out.add_(bias)

    def add_to(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """`residual + self(x)`, in `residual`'s memory: a layer whose output joins the residual
        stream. Through the compact weights as the native decode step adds (on AMX tiles the
        sums start from the residual); else the product, then the sum."""
        if self.reads_compact(x.shape[0]):
            return self.native.gemv_add(x, self.compact, self.bias, residual)
        return residual.add_(self(x))

    def drop_gemm_weight(self) -> None:
        """Free the weight the GEMM multiplies, where the compact weights take batches of every
        size (`CompactWeight.multiplies_any_rows`): no batch reads it again. (A tied head's
        weight is the embedding, which keeps its own reference.)"""
        if self.compact is None or not self.compact.multiplies_any_rows:
            raise ValueError("this layer's GEMM still multiplies some batches")
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)

    def hold_stored_only(self) -> None:
        """Free the float32 weight: the compact weights multiply every batch, past the
        kernels' rows a slab at a time. (A tied head's weight is the embedding, which the model
        frees itself.)"""
        if self.compact is None or self.native is None:
            raise ValueError("this layer has no stored weights to multiply")
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)
        self.stored_only = True
        if self.native.avx512 and self.compact.stored_formats() <= STAGED_FORMATS:
            self.stored_max_rows = STORED_MAX_ROWS  # the staged tiles beat the slabs to here

    def reads_compact(self, rows: int) -> bool:
        """Whether a batch of `rows` rows multiplies the compact weights (else the GEMM): with
        AMX tiles every batch (native/linear/amx_gemm.c, amx_blocks.c: faster than oneDNN's GEMMs at
        prefill sizes too), with panels up to their `panel_max_rows`, else up to
        `compact_max_rows`, or a weight held only as stored its `stored_max_rows`."""
        if self.compact is None:
            return False
        most = max(self.compact_max_rows, self.compact.panel_max_rows, self.stored_max_rows)
        return rows <= most or self.compact.multiplies_any_rows

    def gemm_in_gemm_dtype(self, x: torch.Tensor) -> torch.Tensor:
        """x [tokens, in_features] in `gemm_dtype` -> the product in `gemm_dtype`, no bias."""
        return self._gemm(x, None)

    def _gemm(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, bias, "none", [], "")
        return F.linear(x, self.weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm: normalise in float32, cast back to x's dtype, then scale by `weight`; a
    float32 `weight` of a narrower x (Gemma's 1 + w, see gemma_config.GEMMA_NORM_SHIFT) scales
    first, in float32, and the product is cast, as transformers' Gemma norms compute.

    `weight` may have more than one dimension (broadcast over x's leading dims), which lets
    Qwen3's separate q- and k-norms run as one call over the q and k heads together.
    """
    if x.dtype == torch.float32 and weight.dim() == 1:
        # One fused kernel; identical to the general path in float32.
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    normed = F.rms_norm(x.float(), (x.shape[-1],), None, eps)
    if weight.dtype != x.dtype:
        return (normed * weight).to(x.dtype)
    # Cast-then-scale order matters in bf16: HF multiplies the already-rounded value.
    return normed.to(x.dtype) * weight


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension with a learned scale."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device | str):
        """`dtype`: the weight's, the activations' but for Gemma's float32 1 + w (rms_norm)."""
        super().__init__()
        self.weight = empty_parameter(size, dtype=dtype, device=device)
        self.eps = eps
        # Float32 CPU models normalise with the native kernel (CausalLM.use_native_kernels):
        # one call where torch's rms_norm dispatches several ops.
        self.native: NativeKernels | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise x's last dimension ([tokens, size])."""
        if self.native is not None:
            return self.native.rms_norm(x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)


def rope_inv_freq(
    head_dim: int,
    theta: float,
    scaling: dict[str, Any] | None,
    context_length: int | None = None,
) -> torch.Tensor:
    """Inverse frequencies of RoPE (float32, [head_dim / 2]), llama3-rescaled when asked,
    divided by a GGUF's frequency factors (as llama.cpp divides them), or by LongRoPE's factor
    set for a served context of `context_length` tokens (longrope.longrope_factor_set)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    if scaling is not None and scaling["rope_type"] == LONGROPE:
        if context_length is None:
            raise ValueError("LongRoPE chooses its factors by the served context: give its length")
        _, factors = longrope_factor_set(scaling, context_length)
        # transformers' _compute_longrope_parameters, in its float32 order: the factors
        # multiply theta ** exponents before the reciprocal (not inv_freq / factors).
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta**exponents)
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == FREQ_FACTORS_ROPE:
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    if scaling["rope_type"] == "linear":  # as transformers' _compute_linear_scaling_rope_parameters
        return inv_freq / scaling["factor"]
    # Llama 3.1: stretch long wavelengths by `factor`, keep short ones, blend in between
    # (same formula and float32 arithmetic as transformers' _compute_llama3_parameters).
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Rotate-half (GPT-NeoX style) RoPE with cos/sin precomputed for every position.

    Every path rotates by these tables (apply_rope, the native rope_and_store and the one-call
    decode step), never by angles of its own: LongRoPE's attention factor, which scales cos and
    sin, is in them once for all."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None,
        dtype: torch.dtype,
        device: torch.device | str,
        context_length: int | None = None,
    ) -> None:
        """`context_length`: the served context (LongRoPE chooses its factors by it); None:
        `max_positions`."""
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling, context_length or max_positions)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        cos, sin = angles.cos(), angles.sin()
        if scaling is not None and scaling["rope_type"] == LONGROPE:
            # In float32, before the cast, as transformers scales them (attention_scaling).
            cos, sin = cos * scaling["attention_factor"], sin * scaling["attention_factor"]
        # Stored in the model dtype, as HF casts cos/sin before rotating.
        self.register_buffer("cos", cos.to(dtype=dtype, device=device), persistent=False)
        self.register_buffer("sin", sin.to(dtype=dtype, device=device), persistent=False)

    def angles(self, positions: torch.Tensor) -> TokenAngles:
        """The rotary angles of a batch's tokens at `positions`."""
        return TokenAngles(
            positions, self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1), self
        )


@dataclass(frozen=True)
class TokenAngles:
    """A batch's rotary angles: cos/sin gathered per token, [tokens, 1, head_dim / 2] (broadcast
    over heads), for `apply_rope`; the positions and the tables, for the native kernel."""

    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    tables: RotaryEmbedding


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x ([tokens, heads, head_dim]) by its positions' angles; returns a new tensor."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
