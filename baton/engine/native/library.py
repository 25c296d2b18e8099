"""Baton's native CPU kernels as torch-facing functions: the library `build.py` compiles, loaded
with ctypes (the argument structures it reads are structs.py's).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from baton.engine.compact_weights import BLOCK_FORMATS, FORMATS, CompactWeight
from baton.engine.native.build import NativeBuildError, build_library, native_cache_root
from baton.engine.native.structs import (
    DecodeModelArgs,
    DecoderLayerArgs,
    DecodeStepArgs,
    Matrix,
    RowSampling,
)

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
# linear.h's epilogues of baton_amx_gemm.
_EPILOGUE_STORE, _EPILOGUE_SILU_MUL, _EPILOGUE_ADD = 0, 1, 2


class NativeKernels:
    """The loaded library's kernels, each taking and returning torch tensors. `avx512`: the
    compact kernel and the MLP activation compute 16 floats a vector (the CPU has AVX-512 and
    the plan allows it)."""

    def __init__(self, library: ctypes.CDLL, avx512: bool) -> None:
        self.avx512 = avx512
        # Argument types as the C signatures declare them (see the .c files).
        self._dequantize = _declare(
            library.baton_dequantize, ctypes.c_int, [ctypes.c_int, _ptr, _i64, _i64, _i64, _ptr]
        )
        self._linear = _declare(
            library.baton_linear, ctypes.c_int, [ctypes.POINTER(Matrix), _ptr, _i64, _ptr]
        )
        self._linear_add = _declare(
            library.baton_linear_add, ctypes.c_int, [ctypes.POINTER(Matrix), _ptr, _i64, _ptr, _ptr]
        )
        self._tiles_bytes = _declare(library.baton_bf16_tiles_bytes, _i64, [_i64, _i64])
        self._amx_gemm = _declare(
            library.baton_amx_gemm,
            ctypes.c_int,
            [_ptr, _ptr, _i64, _i64, _ptr, _i64, _ptr, _i64, _ptr],
        )
        self._pack_tiles = _declare(
            library.baton_pack_bf16_tiles, None, [_ptr, _i64, _i64, _i64, _ptr]
        )
        self._block_tiles_count = _declare(
            library.baton_block_tiles_count, _i64, [ctypes.c_int, _i64, _i64]
        )
        self._pack_block_tiles = _declare(
            library.baton_pack_block_tiles,
            ctypes.c_int,
            [ctypes.c_int, _ptr, _i64, _i64, _i64, _ptr],
        )
        # Whether this CPU multiplies tiles (AMX-BF16) and Linux let this process use them:
        # asked once, before any thread runs a tile instruction.
        self.amx = bool(_declare(library.baton_amx_enable, ctypes.c_int, [])())
        self._rope = _declare(
            library.baton_rope_and_store, None, [_ptr, _i64, _ptr, _i64, *[_i64] * 4, *[_ptr] * 6]
        )
        self._silu_mul = _declare(library.baton_silu_mul, None, [_ptr, _i64, _i64, _ptr, _i64])
        self._silu_mul_bf16 = _declare(
            library.baton_silu_mul_bf16, None, [_ptr, _i64, _i64, _ptr, _i64]
        )
        self._rms_norm = _declare(
            library.baton_rms_norm, None, [_ptr, _i64, _i64, _ptr, ctypes.c_float, _ptr]
        )
        self.decode_step = _declare(
            library.baton_decode_step,
            ctypes.c_int,
            [
                ctypes.POINTER(DecoderLayerArgs),
                _i64,
                ctypes.POINTER(DecodeModelArgs),
                ctypes.POINTER(DecodeStepArgs),
            ],
        )
        self._sample_rows = _declare(
            library.baton_sample_rows, None, [_ptr, _i64, _i64, ctypes.POINTER(RowSampling), _ptr]
        )
        self._prefill_attention = _declare(
            library.baton_prefill_attention,
            ctypes.c_int,
            [
                _ptr,
                _i64,
                _i64,
                _i64,
                _ptr,
                _ptr,
                _ptr,
                _i64,
                _i64,
                _i64,
                ctypes.c_float,
                _ptr,
                _i64,
            ],
        )
        self._attention = _declare(
            library.baton_decode_attention,
            ctypes.c_int,
            [_ptr, _i64, _ptr, _i64, *[_ptr] * 5, *[_i64] * 4, ctypes.c_float, _ptr],
        )

    def gemv(
        self, x: torch.Tensor, weight: CompactWeight, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """`x @ W^T (+ bias)`: float32 x [rows, in_features] -> [rows, out_features], as the
        native decode step multiplies (linear.h: the tiles, where given, from two rows). bf16
        rows go to a bf16 weight's tiles as they are (`tiles_product`)."""
        if x.dtype == torch.bfloat16:
            return self.tiles_product(x, weight, bias)
        x = x.contiguous()
        y = torch.empty(x.shape[0], weight.out_features, dtype=torch.float32)
        # ctypes releases the GIL for each call: the scheduler thread runs meanwhile.
        status = self._linear(
            ctypes.byref(self.matrix(weight, bias)), x.data_ptr(), x.shape[0], y.data_ptr()
        )
        if status:
            raise MemoryError("the native linear layer could not allocate its rows")
        return y

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
        x = x.contiguous()
        scratch = torch.empty_like(residual)
        status = self._linear_add(
            ctypes.byref(self.matrix(weight, bias)),
            x.data_ptr(),
            x.shape[0],
            residual.data_ptr(),
            scratch.data_ptr(),
        )
        if status:
            raise MemoryError("the native linear layer could not allocate its rows")
        return residual

    def tiles_product(
        self,
        x: torch.Tensor,
        weight: CompactWeight,
        bias: torch.Tensor | None,
        gated: bool = False,
        into: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`x @ W^T (+ bias)` from a bf16 weight's tiles (amx_gemm.c), float32 [rows,
        out_features]; x float32 (rounded to bf16 there) or bf16 (in_features then a multiple
        of 32). `gated`: W is a gated MLP's [gate | up] (out_features a multiple of 32), and the
        result its activation, bf16(silu(gate) * up) [rows, out_features / 2]. `into`: the
        product (without a bias) is added to these contiguous float32 rows, returned."""
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
        status = self._amx_gemm(
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
            raise MemoryError("the AMX product could not allocate its bf16 rows")
        if status:
            raise ValueError(
                f"no tile product of {x.dtype} rows [{rows}, {x.shape[1]}] by {n} features"
            )
        return y

    def matrix(self, weight: CompactWeight, bias: torch.Tensor | None) -> Matrix:
        """`weight` and `bias` as the C kernels read them (the caller keeps both alive)."""
        return Matrix.of(weight, bias, self.avx512)

    def with_tiles(self, weight: CompactWeight) -> CompactWeight:
        """The weight with its tile-ordered copy, for AMX CPUs (`self.amx`): a bf16 weight's
        (amx_gemm.c) or a block format's in bf16 parts (amx_blocks.c)."""
        n, k = weight.out_features, weight.in_features
        data = weight.data.contiguous()
        if weight.format == "bf16":
            tiles = torch.empty(self._tiles_bytes(n, k) // 2, dtype=torch.int16)
            self._pack_tiles(data.data_ptr(), n, k, data.shape[1], tiles.data_ptr())
            return replace(weight, tiles=tiles)
        if weight.format not in BLOCK_FORMATS:
            raise ValueError(f"{weight.format} weights are not multiplied in tiles")
        kernel_id = FORMATS[weight.format].kernel_id
        tiles = torch.empty(self._block_tiles_count(kernel_id, n, k), dtype=torch.int16)
        status = self._pack_block_tiles(
            kernel_id, data.data_ptr(), n, k, data.shape[1], tiles.data_ptr()
        )
        if status:
            raise ValueError(f"a {weight.format} matrix of {k} inputs is not whole blocks")
        return replace(weight, tiles=tiles)

    def sample_rows(self, logits: torch.Tensor, sampling: Sequence[RowSampling]) -> list[int]:
        """Each row's token from float32 `logits` [rows, vocab] (contiguous ones penalized in
        place), as the native step samples it (sampling.c); -1 for a row whose logits are no
        distribution."""
        logits = logits.contiguous()
        rows = logits.shape[0]
        settings = (RowSampling * rows)(*sampling)
        tokens = (ctypes.c_int64 * rows)()
        self._sample_rows(logits.data_ptr(), rows, logits.shape[1], settings, tokens)
        return list(tokens)

    def dequantize(self, weight: CompactWeight) -> torch.Tensor:
        """The stored matrix as float32 [out_features, in_features]: exactly the values the
        gguf package's dequantization gives, in a fraction of its time."""
        data = weight.data.contiguous()
        out = torch.empty(weight.out_features, weight.in_features, dtype=torch.float32)
        self._dequantize(
            FORMATS[weight.format].kernel_id,
            data.data_ptr(),
            weight.out_features,
            weight.in_features,
            data.shape[1],
            out.data_ptr(),
        )
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """float32 [rows, 2 * inter] (gate, then up) -> silu(gate) * up [rows, inter], as the
        native decode step computes it."""
        gate_up = gate_up.contiguous()
        rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(rows, inter, dtype=torch.float32)
        self._silu_mul(gate_up.data_ptr(), rows, inter, out.data_ptr(), self.avx512)
        return out

    def silu_mul_bf16(self, gate_up: torch.Tensor) -> torch.Tensor:
        """bf16 [rows, 2 * inter] (gate, then up) -> bf16(silu(gate) * up) [rows, inter],
        computed in float32 as the native decode step computes it."""
        gate_up = gate_up.contiguous()
        rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(rows, inter, dtype=torch.bfloat16)
        self._silu_mul_bf16(gate_up.data_ptr(), rows, inter, out.data_ptr(), self.avx512)
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of float32 x [rows, dim] over its last dimension, scaled by `weight`."""
        x = x.contiguous()
        out = torch.empty_like(x)
        self._rms_norm(x.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(), eps, out.data_ptr())
        return out

    def rope_and_store(
        self,
        qk: torch.Tensor,
        v: torch.Tensor,
        cos_table: torch.Tensor,
        sin_table: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> None:
        """Rotate qk ([tokens, q_heads + kv_heads, head_dim], float32, rows may be strided;
        each head contiguous) in place by `positions` (int64) and store its k heads and v
        ([tokens, kv_heads, head_dim]) at `slots` (int64) of the float32 caches."""
        tokens, heads, head_dim = qk.shape
        kv_heads = v.shape[1]
        self._rope(
            qk.data_ptr(),
            qk.stride(0),
            v.data_ptr(),
            v.stride(0),
            tokens,
            heads - kv_heads,
            kv_heads,
            head_dim,
            cos_table.data_ptr(),
            sin_table.data_ptr(),
            positions.data_ptr(),
            slots.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
        )

    def prefill_attention(
        self,
        q: torch.Tensor,
        prefix: int,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        kv_rows: torch.Tensor,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        """Causal attention of one prefill row on AMX (amx_attention.c), into `out`: q and out
        float32 [q_len, q_heads, head_dim] (rows may be strided, each head contiguous), the
        queries after `prefix` cached keys; kv_rows (int64 [kv_heads * (prefix + q_len)]) each
        KV head's keys as rows of the float32 caches viewed [-1, head_dim]; head_dim a multiple
        of 32."""
        q_len, q_heads, head_dim = q.shape
        for tensor in (q, out):
            if tensor.stride(2) != 1 or tensor.stride(1) != head_dim:
                raise ValueError("each query head's values must be contiguous")
        status = self._prefill_attention(
            q.data_ptr(),
            q.stride(0),
            q_len,
            prefix,
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            kv_rows.data_ptr(),
            q_heads,
            k_cache.shape[-2],
            head_dim,
            scale,
            out.data_ptr(),
            out.stride(0),
        )
        if status == -2:
            raise MemoryError("the prefill attention could not allocate its tiles")
        if status:
            raise ValueError(f"no AMX attention for {q_heads} heads of {head_dim} values")

    def decode_attention(
        self,
        q: torch.Tensor,
        rows: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        kv_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """One query per row of `rows` (int32 batch rows) over its pages of the float32 caches
        ([pages, page_size, kv_heads, head_dim]); q: [n, q_heads, head_dim], rows may be
        strided. Returns [n, q_heads, head_dim]."""
        n, q_heads, head_dim = q.shape
        if q.stride(2) != 1 or q.stride(1) != head_dim:
            q = q.contiguous()  # the kernel steps over rows by stride, within them densely
        _, page_size, kv_heads, _ = k_cache.shape
        out = torch.empty(n, q_heads, head_dim, dtype=torch.float32)
        status = self._attention(
            q.data_ptr(),
            q.stride(0),
            rows.data_ptr(),
            n,
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            kv_indptr.data_ptr(),
            kv_indices.data_ptr(),
            kv_lens.data_ptr(),
            q_heads,
            kv_heads,
            head_dim,
            page_size,
            scale,
            out.data_ptr(),
        )
        if status:
            raise MemoryError("decode attention could not allocate its scores")
        return out


def _declare(function: Any, restype: Any, argtypes: list[Any]) -> Any:
    function.restype = restype
    function.argtypes = argtypes
    return function


def load_native_kernels(cache_root: Path | None = None, avx512: bool = False) -> NativeKernels:
    """The kernels, compiled on first use; NativeBuildError where that is impossible here.
    `avx512`: the compact kernel may use AVX-512 (the engine says so where its plan's ISA has
    it); else it keeps 8 floats a vector, which every AVX2 CPU runs."""
    library = build_library(cache_root or native_cache_root())
    try:
        return NativeKernels(ctypes.CDLL(str(library)), avx512)
    except OSError as error:
        raise NativeBuildError(f"cannot load {library}: {error}") from error
