"""`--kv-cache-dtype`: the torch dtype each of its names stores K and V in, and how a value is
rounded into it. Every writer of the cache (`KVPool.write`; the native RoPE + K/V store, bit for
bit the same) and every reader (the attention backends, which widen what they read) holds to
what is decided here."""

from __future__ import annotations

import torch

from baton.config import ConfigurationError

# BatonConfig's KV_CACHE_DTYPES but auto, as vLLM names them: fp8 is fp8_e4m3.
TORCH_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}

# e4m3fn's largest finite value: it has no infinity, so larger values saturate here (as vLLM's
# kernels store them at scale 1.0) instead of wrapping to NaN.
FP8_E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)


def kv_cache_dtype(name: str, compute_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype `--kv-cache-dtype name` stores K and V in: `compute_dtype` for auto.
    ConfigurationError on CUDA for any other dtype than `compute_dtype`, whose attention
    (FlashInfer, the CUDA graphs) reads only its own."""
    dtype = compute_dtype if name == "auto" else TORCH_DTYPES[name]
    if device.type == "cuda" and dtype != compute_dtype:
        raise ConfigurationError(
            f"--kv-cache-dtype {name}: fp8 KV caches, and any other dtype than the model's "
            f"{str(compute_dtype).removeprefix('torch.')}, are not built for CUDA yet; use auto"
        )
    return dtype


def to_cache_dtype(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`values` rounded to nearest even into `dtype`; into e4m3fn saturated at ±448 first."""
    if dtype == torch.float8_e4m3fn:
        values = values.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return values.to(dtype)
