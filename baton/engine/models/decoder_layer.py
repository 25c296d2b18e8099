"""One decoder layer of Llama, Qwen2 and Qwen3: attention over the paged KV cache (fused q/k/v,
Qwen3's q/k norms, RoPE, a window where the layer has one) and the gated MLP, each pre-norm with
a residual (Gemma's layer adds norms after both: gemma.py)."""

from __future__ import annotations

import torch
from torch import nn

from baton.checkpoint.model_config import ModelConfig
from baton.distributed.tensor_parallel import TensorParallel
from baton.engine.attention.base import AttentionBackend
from baton.engine.attention.metadata import AttentionMetadata
from baton.engine.kv.pool import KVPool
from baton.engine.models.layers import (
    Linear,
    RMSNorm,
    TokenAngles,
    apply_rope,
    empty_parameter,
    rms_norm,
)
from baton.engine.models.mlp import GatedMLP
from baton.engine.models.moe import SparseMoE
from baton.engine.models.parallel_layers import row_parallel_linear
from baton.engine.native.library import NativeKernels


class Attention(nn.Module):
    """Self-attention with fused q/k/v, optional Qwen3 (Gemma 3) q/k norms, RoPE and the paged
    KV cache; over the layer's window where it has one, with Gemma 2's soft-capped scores."""

    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        dtype: torch.dtype,
        device: torch.device | str,
        gemm_dtype: torch.dtype | None = None,
        tp: TensorParallel | None = None,
        window: int | None = None,
    ) -> None:
        """`config`: the heads this rank holds (`ModelShards.local_config`); with several ranks
        (`tp`), q/k/v are theirs (column-parallel) and the o projection row-parallel. `window`:
        the layer's (ModelConfig.layer_windows), None for full attention."""
        super().__init__()
        self.layer = layer
        self.window = window
        gemma = config.gemma
        self.softcap = None if gemma is None else gemma.attn_logit_softcapping
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.q_size
        self.kv_size = config.kv_size
        self.eps = config.rms_norm_eps
        self.scale = config.attention_scale
        qkv_size = config.q_size + 2 * config.kv_size
        self.qkv_proj = Linear(
            config.hidden_size, qkv_size, config.qkv_bias, dtype, device, gemm_dtype
        )
        self.o_proj = row_parallel_linear(
            config.q_size,
            config.hidden_size,
            config.o_bias,
            dtype,
            device,
            gemm_dtype,
            tp or TensorParallel(),
        )
        # Qwen3's q_norm and k_norm weights stacked per head, [q heads + kv heads, head_dim], so
        # one norm call covers q and k, which sit side by side in the qkv output.
        qk_heads = self.num_heads + self.num_kv_heads
        self.qk_norm = (
            empty_parameter(qk_heads, self.head_dim, dtype=norm_dtype(config, dtype), device=device)
            if config.qk_norm
            else None
        )
        # Rotates q/k and stores K/V in one native call (CausalLM.use_native_kernels).
        self.native: NativeKernels | None = None

    def forward(
        self,
        hidden: torch.Tensor,
        angles: TokenAngles,
        kv_pool: KVPool,
        attn: AttentionBackend,
        meta: AttentionMetadata,
        residual: torch.Tensor,
    ) -> torch.Tensor:
        """`residual` + the attention of `hidden` (the normed [tokens, hidden]), in
        `residual`'s memory; appends the tokens' K/V to this layer's cache."""
        return self.o_proj.add_to(self.attend(hidden, angles, kv_pool, attn, meta), residual)

    def attend(
        self,
        hidden: torch.Tensor,
        angles: TokenAngles,
        kv_pool: KVPool,
        attn: AttentionBackend,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The heads' attention of `hidden` (the normed [tokens, hidden]) before the o
        projection, [tokens, q_size]; appends the tokens' K/V to this layer's cache."""
        tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        qk = qkv[:, : self.q_size + self.kv_size].view(tokens, -1, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm is not None:
            qk = rms_norm(qk, self.qk_norm, self.eps)
        if self.native is not None:
            self.native.rope_and_store(
                qk,
                v,
                angles.tables.cos,
                angles.tables.sin,
                angles.positions,
                meta.slot_mapping,
                kv_pool.k_cache(self.layer),
                kv_pool.v_cache(self.layer),
            )
            q = qk[:, : self.num_heads]
        else:
            # q and k are rotated together: one set of elementwise kernels instead of two.
            qk = apply_rope(qk, angles.cos, angles.sin)
            q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
            kv_pool.write(self.layer, k, v, meta.slot_mapping)
        k_cache, v_cache = kv_pool.k_cache(self.layer), kv_pool.v_cache(self.layer)
        out = attn.forward(q, k_cache, v_cache, meta, self.scale, self.window, self.softcap)
        return out.reshape(tokens, self.q_size)


def norm_dtype(config: ModelConfig, dtype: torch.dtype) -> torch.dtype:
    """The norms' weights' dtype: the activations', but Gemma's 1 + w, held in float32
    (gemma_config.GEMMA_NORM_SHIFT)."""
    return dtype if config.gemma is None else torch.float32


class DecoderLayer(nn.Module):
    """Pre-norm attention block followed by a pre-norm gated-MLP block, each with a residual."""

    # The dense MLP's class: Gemma's layer takes GeGLU's (gemma.py).
    mlp_class: type[GatedMLP] = GatedMLP

    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        dtype: torch.dtype,
        device: torch.device | str,
        gemm_dtype: torch.dtype | None = None,
        tp: TensorParallel | None = None,
        sparse: bool = False,
        window: int | None = None,
    ) -> None:
        """`config`: the heads and MLP features this rank holds (`ModelShards.local_config`);
        `sparse`: its MLP is the model's mixture of experts (`config.moe`); `window`: its
        attention's (ModelConfig.layer_windows), None for full attention."""
        super().__init__()
        eps, norms = config.rms_norm_eps, norm_dtype(config, dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, eps, norms, device)
        self.self_attn = Attention(config, layer, dtype, device, gemm_dtype, tp, window)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, norms, device)
        if sparse:
            self.mlp: GatedMLP | SparseMoE = SparseMoE(
                config.hidden_size, config.moe, dtype, device, tp
            )
            return
        self.mlp = self.mlp_class(
            config.hidden_size,
            config.intermediate_size,
            config.mlp_bias,
            dtype,
            device,
            gemm_dtype,
            tp,
        )

    def forward(
        self,
        hidden: torch.Tensor,
        angles: TokenAngles,
        kv_pool: KVPool,
        attn: AttentionBackend,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """[tokens, hidden] -> [tokens, hidden], in `hidden`'s memory: the residual stream is
        the model's own (the embedding's output, then each layer's), and the o and down
        projections add their products to it, as the native decode step does."""
        normed = self.input_layernorm(hidden)
        hidden = self.self_attn(normed, angles, kv_pool, attn, meta, residual=hidden)
        return self.mlp.add_to(self.post_attention_layernorm(hidden), hidden)
