"""The native kernels that multiply linear layers' weights (compact_gemv.c, amx_gemm.c,
bf16_dot_gemm.c, amx_blocks.c) as torch-facing functions: the products, the tile-ordered copies
they read on the bf16 hardware, and dequantization. `library.NativeKernels` extends them with
the rest of the library."""

from __future__ import annotations

import ctypes
from dataclasses import replace
from typing import Any

import torch

from baton.engine.native.formats import BLOCK_FORMATS, FORMATS, CompactWeight
from baton.engine.native.slab_products import slab_product
from baton.engine.native.structs import Matrix

I64, PTR = ctypes.c_int64, ctypes.c_void_p
# linear.h's epilogues of a bf16 tiles product.
_EPILOGUE_STORE, _EPILOGUE_SILU_MUL, _EPILOGUE_ADD = 0, 1, 2


def declare(function: Any, restype: Any, argtypes: list[Any]) -> Any:
    """A library function with the argument types its C signature declares."""
    function.restype = restype
    function.argtypes = argtypes
    return function


class LinearKernels:
    """Linear layers' products from their compact weights (and, on the bf16 hardware, tiles).
    `avx512`: the compact kernel computes 16 floats a vector (the CPU has AVX-512 and the plan
    allows it); `amx`, `bf16_dot`: the plan allows AMX's tiles, AVX512_BF16's dot products,
    each used where the CPU has it; `onednn_slabs`: `stored_product` multiplies its float32
    slabs by oneDNN, not torch's BLAS (CpuCapabilities.float32_gemms_in_onednn)."""

    def __init__(
        self,
        library: ctypes.CDLL,
        avx512: bool,
        amx: bool = True,
        bf16_dot: bool = True,
        onednn_slabs: bool = False,
    ) -> None:
        self.avx512 = avx512
        self.onednn_slabs = onednn_slabs
        # Argument types as the C signatures declare them (see the .c files).
        self._dequantize = declare(
            library.baton_dequantize,
            ctypes.c_int,
            [ctypes.c_int, ctypes.c_int, PTR, I64, I64, I64, PTR],
        )
        self._dequantize_rows = declare(
            library.baton_dequantize_rows,
            ctypes.c_int,
            [ctypes.c_int, ctypes.c_int, PTR, I64, I64, PTR, I64, PTR],
        )
        self._linear = declare(
            library.baton_linear, ctypes.c_int, [ctypes.POINTER(Matrix), PTR, I64, PTR]
        )
        self._linear_add = declare(
            library.baton_linear_add, ctypes.c_int, [ctypes.POINTER(Matrix), PTR, I64, PTR, PTR]
        )
        self._tiles_bytes = declare(library.baton_bf16_tiles_bytes, I64, [I64, I64])
        self._tiles_gemm = declare(
            library.baton_bf16_tiles_gemm,
            ctypes.c_int,
            [I64, PTR, PTR, I64, I64, PTR, I64, PTR, I64, PTR],
        )
        self._pack_tiles = declare(library.baton_pack_bf16_tiles, None, [PTR, I64, I64, I64, PTR])
        self._block_tiles_bytes = declare(
            library.baton_block_tiles_bytes, I64, [ctypes.c_int, I64, I64]
        )
        self._pack_block_tiles = declare(
            library.baton_pack_block_tiles,
            ctypes.c_int,
            [ctypes.c_int, PTR, I64, I64, I64, PTR],
        )
        self._panels_bytes = declare(
            library.baton_block_panels_bytes, I64, [ctypes.c_int, I64, I64]
        )
        self._pack_panels = declare(
            library.baton_pack_block_panels, ctypes.c_int, [ctypes.c_int, PTR, I64, I64, I64, PTR]
        )
        # Whether this CPU multiplies tiles (AMX-BF16) and Linux let this process use them:
        # asked once, before any thread runs a tile instruction.
        self.amx = amx and bool(declare(library.baton_amx_enable, ctypes.c_int, [])())
        # Whether bf16 tiles can be multiplied with AVX512_BF16's dot products (bf16_dot_gemm.c):
        # every AMX CPU can too, and AMD's Zen 4 and Zen 5, which have no AMX.
        supported = declare(library.baton_bf16_dot_supported, ctypes.c_int, [])
        self.bf16_dot = bf16_dot and bool(supported())

    @property
    def bf16_tiles(self) -> bool:
        """A bf16 weight's tiles can be multiplied here: on AMX, else with AVX512_BF16."""
        return self.amx or self.bf16_dot

    def gemv(
        self, x: torch.Tensor, weight: CompactWeight, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """`x @ W^T (+ bias)`: float32 x [rows, in_features] -> [rows, out_features], as the
        native decode step multiplies (linear.h: the tiles, where given, from two rows). bf16
        rows go to a bf16 weight's tiles as they are (`tiles_product`)."""
        if x.dtype == torch.bfloat16:
            return self.tiles_product(x, weight, bias)
        y = torch.empty(x.shape[0], weight.out_features, dtype=torch.float32)
        return self._call_linear(self._linear, x, weight, bias, y)

    def gemv_add(
        self,
        x: torch.Tensor,
        weight: CompactWeight,
        bias: torch.Tensor | None,
        residual: torch.Tensor,
    ) -> torch.Tensor:
        """`residual += x @ W^T (+ bias)` in place, as the native decode step adds a layer's
        output to its float32 residual stream (linear.h's baton_linear_add); returns residual.
        bf16 rows (the MLP's activation) go to a bf16 weight's tiles."""
        if not residual.is_contiguous() or residual.dtype != torch.float32:
            raise ValueError("the residual stream must be contiguous float32 rows")
        if x.dtype == torch.bfloat16 and bias is None:
            self.tiles_product(x, weight, None, into=residual)
            return residual
        if x.dtype == torch.bfloat16:
            return residual.add_(self.tiles_product(x, weight, bias))
        return self._call_linear(self._linear_add, x, weight, bias, residual, None)

    def _call_linear(
        self,
        function: Any,
        x: torch.Tensor,
        weight: CompactWeight,
        bias: torch.Tensor | None,
        y: torch.Tensor,
        *more: int | None,
    ) -> torch.Tensor:
        """`function(matrix, x, rows, y, *more)` (baton_linear, baton_linear_add); y."""
        x = x.contiguous()
        # ctypes releases the GIL for each call: the scheduler thread runs meanwhile.
        matrix = ctypes.byref(self.matrix(weight, bias))
        if function(matrix, x.data_ptr(), x.shape[0], y.data_ptr(), *more):
            raise MemoryError("the native linear layer could not allocate its rows")
        return y

    def tiles_product(
        self,
        x: torch.Tensor,
        weight: CompactWeight,
        bias: torch.Tensor | None,
        gated: bool = False,
        into: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`x @ W^T (+ bias)` from a bf16 weight's tiles (on AMX, amx_gemm.c, else with
        AVX512_BF16, bf16_dot_gemm.c), float32 [rows,
        out_features]; x float32 (rounded to bf16 there) or bf16 (in_features then a multiple
        of 32). `gated`: W is a gated MLP's [gate | up] (out_features a multiple of 32), and the
        result its activation, bf16(silu(gate) * up) [rows, out_features / 2]. `into`: the
        product (without a bias) is added to these contiguous float32 rows, returned."""
        if into is not None and (gated or bias is not None):
            raise ValueError("a product added to rows has no bias and no activation")
        if weight.tiles is None or weight.format != "bf16":
            raise ValueError(f"a {weight.format} weight without bf16 tiles")
        if x.dim() != 2 or x.shape[1] != weight.in_features:
            raise ValueError(
                f"rows of {x.shape[-1]} inputs for a weight of {weight.in_features} inputs"
            )
        x = x.contiguous()
        rows, n = x.shape[0], weight.out_features
        if into is not None:
            y, epilogue = into, _EPILOGUE_ADD
        elif gated:
            y, epilogue = torch.empty(rows, n // 2, dtype=torch.bfloat16), _EPILOGUE_SILU_MUL
        else:
            y, epilogue = torch.empty(rows, n, dtype=torch.float32), _EPILOGUE_STORE
        x_float, x_bf16 = (
            (None, x.data_ptr()) if x.dtype == torch.bfloat16 else (x.data_ptr(), None)
        )
        status = self._tiles_gemm(
            int(self.amx),
            x_float,
            x_bf16,
            rows,
            weight.in_features,
            weight.tiles.data_ptr(),
            n,
            None if bias is None else bias.data_ptr(),
            epilogue,
            y.data_ptr(),
        )
        if status == -2:
            raise MemoryError("the tiles product could not allocate its bf16 rows")
        if status:
            raise ValueError(
                f"no tile product of {x.dtype} rows [{rows}, {x.shape[1]}] by {n} features"
            )
        return y

    def matrix(self, weight: CompactWeight, bias: torch.Tensor | None) -> Matrix:
        """`weight` and `bias` as the C kernels read them (the caller keeps both alive)."""
        return Matrix.of(weight, bias, self.avx512, self.amx)

    def with_tiles(self, weight: CompactWeight) -> CompactWeight:
        """The weight with its tile-ordered copy: a bf16 weight's (bf16_tiles.c), where
        `self.bf16_tiles`, or on AMX (`self.amx`) a block format's integers and scales as
        records (amx_block_records.h)."""
        if weight.format == "bf16":
            if not self.bf16_tiles:
                raise ValueError("bf16 tiles are multiplied on AMX or with AVX512_BF16 only")
            n, k = weight.out_features, weight.in_features
            data = weight.data.contiguous()
            tiles = torch.empty(self._tiles_bytes(n, k) // 2, dtype=torch.int16)
            self._pack_tiles(data.data_ptr(), n, k, data.shape[1], tiles.data_ptr())
            return replace(weight, tiles=tiles)
        if weight.format not in BLOCK_FORMATS:
            raise ValueError(f"{weight.format} weights are not multiplied in tiles")
        if not self.amx:
            raise ValueError("block tiles are multiplied on AMX only")
        tiles = self._repack_blocks(weight, self._block_tiles_bytes, self._pack_block_tiles)
        return replace(weight, tiles=tiles)

    def with_panels(self, weight: CompactWeight) -> CompactWeight:
        """The block weight (Q8_0, Q4_0, Q4_1) with its copy in panels of 16 features
        (block_panels.c), which the AVX-512 kernels multiply in batches of a few rows or more
        (`self.avx512` must hold)."""
        if not self.avx512:
            raise ValueError("panels are multiplied with AVX-512 only")
        if weight.format not in BLOCK_FORMATS:
            raise ValueError(f"{weight.format} weights are not kept in panels")
        panels = self._repack_blocks(weight, self._panels_bytes, self._pack_panels)
        return replace(weight, panels=panels)

    def _repack_blocks(self, weight: CompactWeight, size: Any, pack: Any) -> torch.Tensor:
        """A block weight's bytes in another layout: `size(format, n, k)` bytes, filled by
        `pack(format, blocks, n, k, row_bytes, out)` (baton_pack_block_tiles,
        baton_pack_block_panels)."""
        n, k = weight.out_features, weight.in_features
        data = weight.data.contiguous()
        kernel_id = FORMATS[weight.format].kernel_id
        out = torch.empty(size(kernel_id, n, k), dtype=torch.uint8)
        if pack(kernel_id, data.data_ptr(), n, k, data.shape[1], out.data_ptr()):
            raise ValueError(f"a {weight.format} matrix of {k} inputs is not whole blocks")
        return out

    def stored_product(
        self, x: torch.Tensor, weight: CompactWeight, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """`x @ W^T (+ bias)` for a batch past the compact kernels' rows (a prefill chunk) where
        no float32 copy of W is kept: W a float32 slab at a time (slab_products.py), through
        oneDNN where `onednn_slabs`."""
        return slab_product(self._dequantize_into, self.onednn_slabs, x, weight, bias)

    def _dequantize_into(
        self, weight: CompactWeight, start: int, count: int, buffer: torch.Tensor
    ) -> torch.Tensor:
        """Rows start..start+count of a (one-format) stored weight as float32, in `buffer`'s
        first rows; returns them."""
        slab = buffer[:count]
        self._dequantize(
            FORMATS[weight.format].kernel_id,
            self.avx512,
            weight.data[start].data_ptr(),
            count,
            weight.in_features,
            weight.data.stride(0),
            slab.data_ptr(),
        )
        return slab

    def dequantize_rows(self, weight: CompactWeight, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (int64, each in range: the caller checked) of the stored matrix as float32
        [len(ids), in_features]: an embedding's lookups, without a float32 table."""
        ids = ids.contiguous()
        data = weight.data
        out = torch.empty(ids.shape[0], weight.in_features, dtype=torch.float32)
        self._dequantize_rows(
            FORMATS[weight.format].kernel_id,
            self.avx512,
            data.data_ptr(),
            weight.in_features,
            data.stride(0),
            ids.data_ptr(),
            ids.shape[0],
            out.data_ptr(),
        )
        return out

    def dequantize(self, weight: CompactWeight) -> torch.Tensor:
        """The stored matrix as float32 [out_features, in_features]: exactly the values the
        gguf package's dequantization gives, in a fraction of its time."""
        data = weight.data.contiguous()
        out = torch.empty(weight.out_features, weight.in_features, dtype=torch.float32)
        self._dequantize(
            FORMATS[weight.format].kernel_id,
            self.avx512,
            data.data_ptr(),
            weight.out_features,
            weight.in_features,
            data.shape[1],
            out.data_ptr(),
        )
        return out
