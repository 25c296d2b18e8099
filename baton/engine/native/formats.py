"""Weights kept as the checkpoint stores them (bf16, f16, GGUF blocks) for small batches.

A decode step of a few rows reads every weight once and does little arithmetic on it: it is
bound by memory bandwidth. A float32 plan (a CPU without native bf16, or any GGUF) holds 2-6x
more bytes than the checkpoint stored, so besides the float32 weights that large batches and
prefill multiply with (oneDNN, compute-bound), each linear layer keeps its stored bytes for
batches of up to `COMPACT_MAX_ROWS` rows, multiplied by the native kernel
(`baton/engine/native/linear/compact_gemv.c`). The kernel widens each weight to exactly its float32
value, so both paths multiply the same weights; only the order of the sums differs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import torch

# Rows up to which the compact kernel beats oneDNN's packed float32 GEMM. Measured on AMD EPYC
# Zen 3 (2 threads, weights out of cache): 2-4x faster at 1-4 rows and 1.2-1.4x at 16 on SmolLM2
# and 0.5B layer shapes; whole decode steps at 17-32 rows 1.1-2x faster than with float32
# GEMMs past 16 rows (tiny shape, SmolLM2, 0.5B; docs/benchmarks.md).
COMPACT_MAX_ROWS = 32
# Rows up to which a block weight's panels (AVX-512) beat oneDNN's packed float32 GEMM, so that
# prefill chunks and mixed batches of that size take them too. Measured on the AMX Xeon with its
# tiles off (SmolLM2's Q4_1 layer shapes, 2 threads): 1.9x faster at 33 rows, 1.45x at 64,
# 1.09x at 96, even at 128, 0.94x at 144 (docs/benchmarks.md, "AVX-512 without AMX", 325041e).
PANELS_MAX_ROWS = 128
# Rows up to which a weight held only as stored (no float32 or bf16 copy: a GGUF's layers) in
# STAGED_FORMATS is multiplied by the compact kernels with AVX-512 rather than a float32 slab
# at a time (slab_products.py). The staged tiles dequantize a stage once for a block of 128
# rows of x; each slab is written out, packed by oneDNN and read back, an overhead that only
# long batches pay back. Measured on AMD EPYC Zen 5 (2 threads, the 1B Llama shape's four
# Q4_K matrices, GFLOP/s, staged against slabs, at c8128a1): 323 / 265 at 512 rows, 335 / 327
# at 1024 (Q6_K: 332 / 291), 326 / 384 at 2048. (F16's 16-float sweep: 106 / 235 at 256 rows.
# Not measured with AVX2 alone, whose slabs go to torch's BLAS. Those keep COMPACT_MAX_ROWS.)
STORED_MAX_ROWS = 1024


@dataclass(frozen=True)
class CompactFormat:
    """One storage format: its id in the native kernel, and `block` weights per `block_bytes`."""

    kernel_id: int
    block: int
    block_bytes: int


FORMATS = {
    "bf16": CompactFormat(0, 32, 64),  # read 32 weights at a time, like the GGUF blocks
    "f16": CompactFormat(1, 32, 64),
    "q8_0": CompactFormat(2, 32, 34),  # f16 scale d, 32 int8: w = d * q
    "q4_0": CompactFormat(3, 32, 18),  # f16 d, 16 bytes of nibbles: w = d * (q - 8)
    "q4_1": CompactFormat(4, 32, 20),  # f16 d, f16 m, 16 bytes of nibbles: w = d * q + m
    # llama.cpp's k-quants: super-blocks of 256 weights, eight sub-blocks with their own scales
    # (native/linear/block_formats.h has each layout).
    "q4_k": CompactFormat(5, 256, 144),
    "q5_k": CompactFormat(6, 256, 176),
    "q6_k": CompactFormat(7, 256, 210),
    "q3_k": CompactFormat(8, 256, 110),
    "q2_k": CompactFormat(9, 256, 84),
    "iq4_nl": CompactFormat(10, 32, 18),  # f16 d, nibbles indexing 16 non-uniform levels
    "iq4_xs": CompactFormat(11, 256, 136),
    "q5_0": CompactFormat(12, 32, 22),
    "q5_1": CompactFormat(13, 32, 24),
}
# The formats whose weights are small integers times a block's scale (plus its minimum), which
# AMX multiplies in float32 precision (native/linear/amx_blocks.c) and AVX-512 CPUs also keep in
# panels of 16 features (native/linear/block_panels.c).
BLOCK_FORMATS = ("q8_0", "q4_0", "q4_1")
# The formats AVX-512 multiplies from 8 rows in the staged tiles (native/linear/staged_gemm.c):
# every one but those whose 16-float sweeps take any number of rows (wide_sweeps512.c: bf16,
# f16 and the block formats; Q4_K's and Q6_K's stop at 7).
STAGED_FORMATS = frozenset(FORMATS) - {"bf16", "f16", *BLOCK_FORMATS}
# The format of a fused weight whose parts are stored in different formats (CompactWeight.parts).
PARTS = "parts"
# The fewest rows a bf16 weight's tiles multiply (linear.c's TILES_MIN_ROWS): one row keeps
# the compact kernel's exact float32 products at the same bytes read.
TILES_MIN_ROWS = 2
_TORCH_FORMATS = {torch.bfloat16: "bf16", torch.float16: "f16"}


@dataclass(frozen=True)
class CompactWeight:
    """A [out_features, in_features] weight in a compact format: `data` is uint8
    [out_features, row_bytes], each row its in_features / block blocks in order. `tiles`, on AMX
    CPUs only, holds the weight once more in the tile unit's order, which larger batches
    multiply instead: a bf16 weight as bf16, from TILES_MIN_ROWS rows (native/linear/amx_gemm.c); a
    block format's integers and scales, widened to bf16 in the kernel, from 5-9 rows
    (native/linear/amx_blocks.c). Either way the tiles take every larger batch, prefill chunks
    included. `panels`, on AVX-512 CPUs only, holds a block format's weight once more in panels
    of 16 features, which batches of a few rows or more (below the tiles') multiply instead
    (native/linear/block_panels.c), up to PANELS_MAX_ROWS rows.

    A fused weight whose parts are stored in different formats (a GGUF's q and k in Q4_K, its v
    in Q6_K) has format PARTS and its `parts` stacked row-wise; its `data` is [out_features, 0].
    """

    format: str
    data: torch.Tensor
    in_features: int
    tiles: torch.Tensor | None = None
    panels: torch.Tensor | None = None
    parts: tuple[CompactWeight, ...] = ()

    @property
    def out_features(self) -> int:
        return self.data.shape[0]

    @property
    def multiplies_any_rows(self) -> bool:
        """The native kernels multiply batches of any size with it: it has tiles (every part
        has)."""
        if self.parts:
            return all(part.multiplies_any_rows for part in self.parts)
        return self.tiles is not None

    @property
    def panel_max_rows(self) -> int:
        """The most rows its panels take from the GEMM (PANELS_MAX_ROWS; 0 without panels, or
        where a part has none)."""
        if self.parts:
            return min(part.panel_max_rows for part in self.parts)
        return PANELS_MAX_ROWS if self.panels is not None else 0

    def map_parts(self, change: Callable[[CompactWeight], CompactWeight]) -> CompactWeight:
        """`change` applied to the weight, or to each of its parts."""
        if not self.parts:
            return change(self)
        return replace(self, parts=tuple(change(part) for part in self.parts))

    def stored_formats(self) -> set[str]:
        """The formats its bytes are stored in: its own, or its parts'."""
        return {part.format for part in self.parts} if self.parts else {self.format}

    @staticmethod
    def from_tensor(tensor: torch.Tensor) -> CompactWeight | None:
        """The stored bytes of a bf16/f16 matrix; None for another dtype or an unsupported width."""
        name = _TORCH_FORMATS.get(tensor.dtype)
        if name is None or tensor.dim() != 2 or tensor.shape[1] % FORMATS[name].block:
            return None
        return CompactWeight(name, tensor.contiguous().view(torch.uint8), tensor.shape[1])


def concat_rows(parts: Iterable[CompactWeight]) -> CompactWeight | None:
    """The parts stacked row-wise (a fused q/k/v or gate/up weight): one weight where they share
    a format, else a PARTS weight (a GGUF storing v in another type than q and k); None where
    their widths differ."""
    parts = list(parts)
    first = parts[0]
    if any(part.in_features != first.in_features for part in parts):
        return None
    if len(parts) == 1:
        return first
    if all(part.format == first.format for part in parts):
        data = torch.cat([part.data for part in parts])
        return CompactWeight(first.format, data, first.in_features)
    rows = sum(part.out_features for part in parts)
    empty = torch.empty(rows, 0, dtype=torch.uint8)
    return CompactWeight(PARTS, empty, first.in_features, parts=tuple(parts))
