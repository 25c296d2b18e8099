"""Gemma 2 and Gemma 3's decoder layer: Llama's with a norm after attention and after the MLP
as well as before each, and GeGLU (`gelu_tanh(gate) * up`) for SwiGLU (docs/design.md,
"Architectures"). Their norms scale by 1 + w, which loading folds into the weights
(gemma_config.GEMMA_NORM_SHIFT); their windows, soft caps and local RoPE are the attention's and the
model's (decoder_layer.py, causal_lm.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from baton.checkpoint.model_config import ModelConfig
from baton.distributed.tensor_parallel import TensorParallel
from baton.engine.attention.base import AttentionBackend
from baton.engine.attention.metadata import AttentionMetadata
from baton.engine.kv.pool import KVPool
from baton.engine.models.decoder_layer import DecoderLayer, norm_dtype
from baton.engine.models.layers import RMSNorm, TokenAngles
from baton.engine.models.mlp import GatedMLP


class GeluGatedMLP(GatedMLP):
    """`down(gelu_tanh(gate(x)) * up(x))` (transformers' gelu_pytorch_tanh), gate and up fused
    into one product; float32 rows activated by the native kernel, as the native decode step
    activates them."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[tokens, hidden] -> [tokens, hidden]."""
        gate_up = self.gate_up_proj(x)
        if self.native is not None:  # (set on float32 models only, so float32 rows)
            return self.down_proj(self.native.gelu_tanh_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh").mul_(up))

    def add_to(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """`residual + self(x)`, in `residual`'s memory."""
        return residual.add_(self(x))


class GemmaDecoderLayer(DecoderLayer):
    """Norm, attention, norm, residual; norm, GeGLU MLP, norm, residual (transformers'
    Gemma2DecoderLayer, Gemma3DecoderLayer)."""

    mlp_class = GeluGatedMLP

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
        """As DecoderLayer's (a Gemma has no experts: `sparse` is False)."""
        super().__init__(config, layer, dtype, device, gemm_dtype, tp, sparse, window)
        eps, norms = config.rms_norm_eps, norm_dtype(config, dtype)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps, norms, device)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps, norms, device)

    def forward(
        self,
        hidden: torch.Tensor,
        angles: TokenAngles,
        kv_pool: KVPool,
        attn: AttentionBackend,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """[tokens, hidden] -> [tokens, hidden], in `hidden`'s memory (the residual stream)."""
        attention = self.self_attn
        attended = attention.attend(self.input_layernorm(hidden), angles, kv_pool, attn, meta)
        hidden.add_(self.post_attention_layernorm(attention.o_proj(attended)))
        mlp_out = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden.add_(self.post_feedforward_layernorm(mlp_out))


def scale_embeddings(hidden: torch.Tensor, hidden_size: int) -> torch.Tensor:
    """Gemma's embeddings times sqrt(hidden_size), in place: the factor a float32 rounded to the
    activations' dtype, as transformers' scaled embedding (its float32 buffer) multiplies them."""
    return hidden.mul_(torch.tensor(hidden_size**0.5, dtype=torch.float32).to(hidden.dtype))
