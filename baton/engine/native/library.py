"""Baton's native CPU kernels as torch-facing functions: the library `build.py` compiles, loaded
with ctypes (the argument structures it reads are structs.py's).
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from baton.engine.native.build import NativeBuildError, build_library, native_cache_root
from baton.engine.native.linear_kernels import I64, PTR, LinearKernels, declare
from baton.engine.native.structs import (
    DecodeModelArgs,
    DecoderLayerArgs,
    DecodeStepArgs,
    ExpertMatrices,
    RowSampling,
)
from baton.hardware import CpuCapabilities, isa_rank

# The KV cache's element types as the attention kernels number them (attention/kv_cache.h's
# KvType): they widen each to float32 as they read it, and the K/V store rounds into it.
KV_ELEMENT_TYPES = {
    torch.float32: 0,
    torch.bfloat16: 1,
    torch.float16: 2,
    torch.float8_e4m3fn: 3,
    torch.float8_e5m2: 4,
}


def kv_element_type(cache: torch.Tensor) -> int:
    """The kernels' number for `cache`'s dtype; ValueError for one they do not read."""
    if cache.dtype not in KV_ELEMENT_TYPES:
        raise ValueError(f"the native kernels read no KV cache of {cache.dtype}")
    return KV_ELEMENT_TYPES[cache.dtype]


logger = logging.getLogger(__name__)


class NativeKernels(LinearKernels):
    """The loaded library's kernels, each taking and returning torch tensors: the linear
    layers' products (LinearKernels), and the decode step's, the activation's, the norms', RoPE's,
    attention's and sampling's. `avx512`: the compact kernel and the MLP activation compute 16
    floats a vector (the CPU has AVX-512 and the plan allows it)."""

    def __init__(
        self,
        library: ctypes.CDLL,
        avx512: bool,
        amx: bool = True,
        bf16_dot: bool = True,
        onednn_slabs: bool = False,
    ) -> None:
        super().__init__(library, avx512, amx, bf16_dot, onednn_slabs)
        self._rope = declare(
            library.baton_rope_and_store, None, [PTR, I64, PTR, I64, *[I64] * 4, *[PTR] * 6, I64]
        )
        self._silu_mul = declare(library.baton_silu_mul, None, [PTR, I64, I64, PTR, I64])
        self._silu_mul_bf16 = declare(library.baton_silu_mul_bf16, None, [PTR, I64, I64, PTR, I64])
        self._gelu_tanh_mul = declare(library.baton_gelu_tanh_mul, None, [PTR, I64, I64, PTR])
        self._rms_norm = declare(
            library.baton_rms_norm, None, [PTR, I64, I64, PTR, ctypes.c_float, PTR]
        )
        self.decode_step = declare(
            library.baton_decode_step,
            ctypes.c_int,
            [
                ctypes.POINTER(DecoderLayerArgs),
                I64,
                ctypes.POINTER(DecodeModelArgs),
                ctypes.POINTER(DecodeStepArgs),
            ],
        )
        self._moe_experts = declare(
            library.baton_moe_experts,
            ctypes.c_int,
            [PTR, PTR, PTR, I64, PTR, I64, PTR, PTR, I64, PTR],
        )
        self._sample_rows = declare(
            library.baton_sample_rows, None, [PTR, I64, I64, ctypes.POINTER(RowSampling), PTR]
        )
        # A prefill row's attention: bf16 on AMX tiles (amx_attention.c), or float32 with
        # AVX2 FMAs (prefill_attention.c), which also takes a window and a soft cap.
        prefill_arguments = [PTR, *[I64] * 3, *[PTR] * 3, *[I64] * 3, ctypes.c_float, PTR, I64, I64]
        self._prefill_attention = {
            True: declare(library.baton_prefill_attention, ctypes.c_int, prefill_arguments),
            False: declare(
                library.baton_prefill_attention_f32,
                ctypes.c_int,
                [*prefill_arguments, I64, ctypes.c_float],
            ),
        }
        self._attention = declare(
            library.baton_decode_attention,
            ctypes.c_int,
            [PTR, I64, PTR, I64, *[PTR] * 5, *[I64] * 4, *[ctypes.c_float] * 2, I64, I64, PTR],
        )

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

    def moe_experts(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, stored: ExpertMatrices
    ) -> torch.Tensor:
        """A mixture-of-experts block's routed experts (moe_experts.c): float32 x [rows, hidden],
        each row's chosen `experts` [rows, k] and their float32 routing `weights` -> float32
        [rows, hidden], each expert the batch chose read once."""
        x, experts = x.contiguous(), experts.to(torch.int64).contiguous()
        weights = weights.to(torch.float32).contiguous()
        out = torch.empty_like(x)
        rows, top_k = experts.shape
        failed = self._moe_experts(
            ctypes.addressof(stored.gate),
            ctypes.addressof(stored.up),
            ctypes.addressof(stored.down),
            stored.num_experts,
            x.data_ptr(),
            rows,
            experts.data_ptr(),
            weights.data_ptr(),
            top_k,
            out.data_ptr(),
        )
        if failed:
            raise MemoryError("the experts' products could not allocate their rows")
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """float32 [rows, 2 * inter] (gate, then up) -> silu(gate) * up [rows, inter], as the
        native decode step computes it."""
        gate_up = gate_up.contiguous()
        rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(rows, inter, dtype=torch.float32)
        self._silu_mul(gate_up.data_ptr(), rows, inter, out.data_ptr(), self.avx512)
        return out

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """float32 [rows, 2 * inter] (gate, then up) -> gelu_tanh(gate) * up [rows, inter]
        (Gemma's GeGLU), as the native decode step computes it."""
        gate_up = gate_up.contiguous()
        rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(rows, inter, dtype=torch.float32)
        self._gelu_tanh_mul(gate_up.data_ptr(), rows, inter, out.data_ptr())
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
        ([tokens, kv_heads, head_dim]) at `slots` (int64) of the caches, rounded into their
        dtype (KV_ELEMENT_TYPES) bit for bit as KVPool.write rounds them."""
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
            kv_element_type(k_cache),
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
        on_amx: bool,
        window: int | None = None,
        softcap: float | None = None,
    ) -> None:
        """Causal attention of one prefill row, into `out`: in bf16 on AMX tiles where `on_amx`
        (amx_attention.c; head_dim a multiple of 32), else in float32 (prefill_attention.c;
        head_dim a multiple of 16), up to 256 values a head. q and out float32 [q_len, q_heads,
        head_dim] (rows may be strided, each head contiguous), the queries after `prefix`
        cached keys; kv_rows (int64 [kv_heads * (prefix + q_len)]) each KV head's keys as rows
        of the caches viewed [-1, head_dim], in any dtype of KV_ELEMENT_TYPES. `window` and
        `softcap` as AttentionBackend.forward's, in float32 only (ValueError on AMX)."""
        q_len, q_heads, head_dim = q.shape
        for tensor in (q, out):
            if tensor.stride(2) != 1 or tensor.stride(1) != head_dim:
                raise ValueError("each query head's values must be contiguous")
        limits = () if on_amx else (window or 0, softcap or 0.0)
        if on_amx and (window is not None or softcap is not None):
            raise ValueError("the AMX prefill attention has no window or soft cap")
        status = self._prefill_attention[on_amx](
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
            kv_element_type(k_cache),
            *limits,
        )
        if status == -2:
            raise MemoryError("the prefill attention could not allocate its buffers")
        if status:
            raise ValueError(
                f"no native prefill attention for {q_heads} heads of {head_dim} values"
            )

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
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """One float32 query per row of `rows` (int32 batch rows) over its pages of the caches
        ([pages, page_size, kv_heads, head_dim], in any dtype of KV_ELEMENT_TYPES); q: [n,
        q_heads, head_dim], rows may be strided; `window` and `softcap` as
        AttentionBackend.forward's. Returns [n, q_heads, head_dim]."""
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
            softcap or 0.0,
            window or 0,
            kv_element_type(k_cache),
            out.data_ptr(),
        )
        if status:
            raise MemoryError("decode attention could not allocate its scores")
        return out


def load_native_kernels(
    cache_root: Path | None = None,
    avx512: bool = False,
    amx: bool = True,
    bf16_dot: bool = True,
    onednn_slabs: bool = False,
) -> NativeKernels:
    """The kernels, compiled on first use; NativeBuildError where that is impossible here.
    `avx512`: the compact kernel may use AVX-512 (the engine says so where its plan's ISA has
    it); else it keeps 8 floats a vector, which every AVX2 CPU runs. `amx`, `bf16_dot`: AMX's
    tiles and AVX512_BF16's dot products may multiply bf16 tiles where the CPU has them (the
    engine allows each where its plan's ISA reaches it). `onednn_slabs`: stored weights'
    float32 slabs are multiplied by oneDNN rather than torch's BLAS
    (CpuCapabilities.float32_gemms_in_onednn)."""
    library = build_library(cache_root or native_cache_root())
    try:
        return NativeKernels(ctypes.CDLL(str(library)), avx512, amx, bf16_dot, onednn_slabs)
    except OSError as error:
        raise NativeBuildError(f"cannot load {library}: {error}") from error


def native_kernels_for(cpu: CpuCapabilities) -> NativeKernels | None:
    """The kernels where the CPU's ISA (as the plan caps it) runs them (AVX2 and up) and they
    build, else None (with one line saying why they did not build: the engine then computes
    with torch alone)."""
    isa = cpu.isa
    if isa_rank(isa) < isa_rank("avx2"):
        return None
    try:
        return load_native_kernels(
            avx512=isa_rank(isa) >= isa_rank("avx512"),
            amx=isa == "amx",
            bf16_dot=isa_rank(isa) >= isa_rank("avx512_bf16"),
            onednn_slabs=cpu.float32_gemms_in_onednn,
        )
    except NativeBuildError as error:
        logger.warning("computing with torch alone: no native kernels here: %s", error)
        return None
