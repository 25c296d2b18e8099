"""Products of stored weights (a GGUF's blocks) for batches past the compact kernels' rows, a
prefill chunk's, where no float32 copy of the weight is kept: the weight dequantized a slab of
features at a time into one float32 buffer, each slab multiplied by torch's GEMM, or by oneDNN's
where torch's BLAS runs below the CPU's ISA (CpuCapabilities.float32_gemms_in_onednn). The same
exact weights as the compact kernels' (only the order of the sums differs), at the memory of
the stored bytes plus one slab."""

from __future__ import annotations

from collections.abc import Callable

import torch

from baton.engine.native.formats import CompactWeight

# The float32 slab of a stored weight that a product past the compact kernels' rows
# dequantizes and multiplies at a time (slab_product): big enough that each GEMM
# runs at the rate of the whole one (on AMD EPYC Zen 3, 1 thread, 256 x 2048 rows by 8192
# features: slabs of 256-1024 features as fast as the whole product) and that a small model's
# layer is one slab, whose product is the result with no transposed copy (SmolLM2's 576-wide
# layers; with 4 MB slabs its 1024-token prefill ran 20-30 % slower than from float32 weights).
SLAB_BYTES = 16 << 20
SLAB_MIN_FEATURES = 64

# (part, first feature, count, buffer) -> those features' rows of `part` as float32 in buffer.
Dequantize = Callable[[CompactWeight, int, int, torch.Tensor], torch.Tensor]


def slab_product(
    dequantize_into: Dequantize,
    onednn: bool,
    x: torch.Tensor,
    weight: CompactWeight,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """`x @ W^T (+ bias)`, float32 [rows, out_features], W a slab at a time (above)."""
    x = x.contiguous()
    rows, k = x.shape[0], weight.in_features
    parts = weight.parts or (weight,)
    slab_rows = max(SLAB_MIN_FEATURES, SLAB_BYTES // (4 * k))
    buffer = torch.empty(min(slab_rows, max(p.out_features for p in parts)), k)
    if onednn:
        return _onednn_slab_product(dequantize_into, x, parts, slab_rows, buffer, bias)
    if not weight.parts and weight.out_features <= slab_rows:
        # One slab: its product is the result, in place, with no transposed copy.
        dequantize_into(weight, 0, weight.out_features, buffer)
        y = torch.mm(x, buffer.t())
        return y if bias is None else y.add_(bias)
    # y^T, so that each slab's product is whole rows of it.
    product = torch.empty(weight.out_features, rows, dtype=torch.float32)
    first = 0
    for part in parts:
        for start in range(0, part.out_features, slab_rows):
            count = min(slab_rows, part.out_features - start)
            slab = dequantize_into(part, start, count, buffer)
            torch.mm(slab, x.t(), out=product[first + start : first + start + count])
        first += part.out_features
    y = product.t().contiguous()
    return y if bias is None else y.add_(bias)


def _onednn_slab_product(
    dequantize_into: Dequantize,
    x: torch.Tensor,
    parts: tuple[CompactWeight, ...],
    slab_rows: int,
    buffer: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """The slabs through oneDNN: each packed for the batch's rows (the call's whole cost over
    the plain GEMM, paid back from 64 rows on AMD Zen 5), its product written into its columns
    of y."""
    rows = x.shape[0]
    y = torch.empty(rows, sum(part.out_features for part in parts), dtype=torch.float32)
    first = 0
    for part in parts:
        for start in range(0, part.out_features, slab_rows):
            count = min(slab_rows, part.out_features - start)
            slab = dequantize_into(part, start, count, buffer)
            packed = torch.ops.mkldnn._reorder_linear_weight(slab, rows)
            product = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
            y[:, first + start : first + start + count] = product
        first += part.out_features
    return y if bias is None else y.add_(bias)
