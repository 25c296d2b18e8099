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
    if compact_format in SCALE_OFFSETS:
        blocks = random_blocks(compact_format, weight.shape[0], weight.shape[1], seed=weight.size)
    else:
        blocks = gguf.quants.quantize(weight, quant)
    values = gguf.quants.dequantize(blocks, quant).reshape(weight.shape)
    return CompactWeight(compact_format, torch.from_numpy(blocks), weight.shape[1]), (
        torch.from_numpy(values)
    )


# Where the f16 scales sit in a block of each format gguf cannot quantize (llama.cpp's
# ggml-common.h): every other byte of a block is a quant or a sub-scale, any value valid.
SCALE_OFFSETS = {
    "q2_k": (80, 82),
    "q3_k": (108,),
    "q4_k": (0, 2),
    "q5_k": (0, 2),
    "q6_k": (208,),
    "iq4_nl": (0,),
    "iq4_xs": (0,),
}


def random_blocks(
    compact_format: str, rows: int, in_features: int, seed: int = 0, scale: float = 0.01
) -> np.ndarray:
    """uint8 [rows, row bytes]: random blocks of a format gguf cannot quantize (k-quants,
    IQ4): random quants and sub-scales, finite f16 scales of about `scale`. Their values are
    what gguf's dequantization says."""
    quant = getattr(gguf.GGMLQuantizationType, compact_format.upper())
    block, block_bytes = gguf.GGML_QUANT_SIZES[quant]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, in_features // block, block_bytes), dtype=np.uint8)
    for offset in SCALE_OFFSETS[compact_format]:
        scales = (rng.standard_normal(blocks.shape[:2]) * scale).astype(np.float16)
        blocks[:, :, offset : offset + 2] = scales.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(rows, -1)


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
    expected = x.double() @ values.double().T + bias.double()
    product = native.gemv(x, prepare(compact), bias)
    assert_float32_sums(product, expected, x, values)


def assert_float32_sums(
    product: torch.Tensor, expected: torch.Tensor, x: torch.Tensor, values: torch.Tensor
) -> None:
    """`product` (float32 sums of x times the weights `values`) is `expected` (float64) up to
    float32 rounding: a sum's error is bounded by the sum of its terms' magnitudes times a few
    ulps per term in the worst case, about its square root's worth in practice (1e-5 of the
    magnitudes is 80 ulps: wide of the sums here, far short of a wrong weight)."""
    magnitudes = x.abs().double() @ values.abs().double().T
    error = (product.double() - expected).abs()
    worst = (error / (magnitudes + 1e-30)).max()
    assert worst <= 1e-5, f"an output is off by {float(worst):.2e} of its terms' magnitude"
