"""Compact weights for the native kernels' tests, and their reference: a float64 matmul."""

from __future__ import annotations

from collections.abc import Callable

import gguf
import numpy as np
import torch

from baton.engine.native.formats import CompactWeight
from baton.engine.native.library import NativeKernels


def stored_weight(weight: np.ndarray, compact_format: str) -> tuple[CompactWeight, torch.Tensor]:
    """`weight` stored in `compact_format`, and the float32 values the stored bytes stand for
    (as gguf dequantizes them, or as bf16/f16 widen)."""
    if compact_format in ("bf16", "f16"):
        dtype = torch.bfloat16 if compact_format == "bf16" else torch.float16
        stored = torch.from_numpy(weight).to(dtype)
        compact = CompactWeight.from_tensor(stored)
        assert compact is not None
        return compact, stored.float()
    quant = getattr(gguf.GGMLQuantizationType, compact_format.upper())
    blocks = gguf.quants.quantize(weight, quant)
    values = gguf.quants.dequantize(blocks, quant).reshape(weight.shape)
    return CompactWeight(compact_format, torch.from_numpy(blocks), weight.shape[1]), (
        torch.from_numpy(values)
    )


def check_against_float64(
    native: NativeKernels,
    compact_format: str,
    rows: int,
    out_features: int,
    in_features: int,
    prepare: Callable[[CompactWeight], CompactWeight] = lambda weight: weight,
) -> None:
    """`native.gemv` of random rows by a random stored weight (given to `prepare` first, e.g.
    for its panels), bias included, against the float64 product of the stored values."""
    rng = np.random.default_rng(rows)
    weight = rng.normal(size=(out_features, in_features)).astype(np.float32)
    compact, values = stored_weight(weight, compact_format)
    x = torch.from_numpy(rng.normal(size=(rows, in_features)).astype(np.float32))
    bias = torch.from_numpy(rng.normal(size=out_features).astype(np.float32))
    expected = (x.double() @ values.double().T + bias.double()).float()
    # A float32 sum's rounding error grows like the square root of its length.
    atol = 1e-4 * (in_features / 160) ** 0.5
    product = native.gemv(x, prepare(compact), bias)
    torch.testing.assert_close(product, expected, rtol=1e-5, atol=atol)
