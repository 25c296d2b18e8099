"""Baton's native CPU kernels as torch-facing functions: the library `build.py` compiles, loaded
with ctypes (the argument structures it reads are structs.py's).
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from baton.engine.native.attention_kernels import AttentionKernels
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

logger = logging.getLogger(__name__)


class NativeKernels(LinearKernels, AttentionKernels):
    """The loaded library's kernels, each taking and returning torch tensors: the linear
    layers' products (LinearKernels), attention's and RoPE's (AttentionKernels), and the decode
    step's, the activations', the norms', the experts' and sampling's. `avx512`: the compact
    kernel and the MLP activation compute 16 floats a vector (the CPU has AVX-512 and the plan
    allows it)."""

    def __init__(
        self,
        library: ctypes.CDLL,
        avx512: bool,
        amx: bool = True,
        bf16_dot: bool = True,
        onednn_slabs: bool = False,
    ) -> None:
        LinearKernels.__init__(self, library, avx512, amx, bf16_dot, onednn_slabs)
        AttentionKernels.__init__(self, library)
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
