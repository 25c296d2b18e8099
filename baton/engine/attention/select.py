"""Picks the attention backend for a device: FlashInfer on CUDA when it imports, torch otherwise."""

from __future__ import annotations

import torch

from baton.checkpoint.model_config import ModelConfig
from baton.engine.attention.base import AttentionBackend
from baton.engine.attention.flashinfer_backend import FlashInferAttention, flashinfer_available
from baton.engine.attention.torch_backend import TorchPagedAttention
from baton.engine.native.library import NativeKernels

BACKEND_NAMES = ("auto", "torch", "flashinfer")


def make_attention_backend(
    name: str,
    device: torch.device | str,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    native: NativeKernels | None = None,
    prefill_dtype: torch.dtype | None = None,
    amx_prefill: bool = False,
    layer_windows: tuple[int | None, ...] = (),
    softcap: float | None = None,
    scale: float | None = None,
) -> AttentionBackend:
    """Build backend `name` ("auto" | "torch" | "flashinfer") for the given model shape;
    `native`: the torch backend's decode rows run the native kernel (float32 CPU caches);
    `prefill_dtype`: its prefill rows attend in that dtype; `amx_prefill`: on AMX (see
    TorchPagedAttention). `layer_windows`, `softcap`, `scale`: the model's (ModelConfig),
    which the torch backend takes from each layer and FlashInfer plans (a wrapper per window,
    the soft cap and the scale in every plan; scale None: 1 / sqrt(head_dim))."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; expected one of {BACKEND_NAMES}")
    device = torch.device(device)
    on_cuda = device.type == "cuda"
    if name == "flashinfer" and not on_cuda:
        raise ValueError(f"the flashinfer backend needs a CUDA device, got {device}")
    if name == "flashinfer" or (name == "auto" and on_cuda and flashinfer_available()):
        return FlashInferAttention(
            num_q_heads,
            num_kv_heads,
            head_dim,
            dtype,
            device,
            windows=layer_windows,
            softcap=softcap,
            scale=scale,
        )
    return TorchPagedAttention(
        num_q_heads,
        num_kv_heads,
        native=native,
        prefill_dtype=prefill_dtype,
        amx_prefill=amx_prefill,
    )


def model_attention_backend(
    name: str,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | str,
    native: NativeKernels | None = None,
    prefill_dtype: torch.dtype | None = None,
    amx_prefill: bool = False,
) -> AttentionBackend:
    """`make_attention_backend` for `config`'s heads and windows."""
    return make_attention_backend(
        name,
        device,
        config.num_heads,
        config.num_kv_heads,
        config.head_dim,
        dtype,
        native,
        prefill_dtype,
        amx_prefill,
        config.layer_windows,
        None if config.gemma is None else config.gemma.attn_logit_softcapping,
        config.attention_scale,
    )
