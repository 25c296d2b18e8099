"""The gated MLP of Llama, Qwen2 and Qwen3: `down(silu(gate(x)) * up(x))`, its gate and up fused
into one product, with the native kernels' fused activations where the plan has them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from baton.distributed.tensor_parallel import TensorParallel
from baton.engine.models.layers import Linear
from baton.engine.models.parallel_layers import row_parallel_linear
from baton.engine.native.formats import TILES_MIN_ROWS
from baton.engine.native.library import NativeKernels

# Rows of a prefill's MLP multiplied at a time where its GEMMs run in bf16: the bf16 weights are
# packed for this many rows (PREFILL_PACK_ROWS), where the AMX GEMMs ran fastest, and the block's
# [rows, 2 * intermediate] product stays a few MB.
MLP_BLOCK_ROWS = 512


class GatedMLP(nn.Module):
    """`down(silu(gate(x)) * up(x))`, with gate and up fused into one matmul."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | str,
        gemm_dtype: torch.dtype | None = None,
        tp: TensorParallel | None = None,
    ) -> None:
        """`intermediate_size`: the features this rank holds of the gate and the up projection
        (column-parallel); with several ranks (`tp`), the down projection is row-parallel."""
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(
            hidden_size, 2 * intermediate_size, bias, dtype, device, gemm_dtype
        )
        self.down_proj = row_parallel_linear(
            intermediate_size, hidden_size, bias, dtype, device, gemm_dtype, tp or TensorParallel()
        )
        # Set by CausalLM.use_native_kernels: the activation of float32 rows is the native one,
        # and where the GEMMs run in bf16, a prefill's activation goes from the gate/up product
        # to the down product in bf16 (native/layer/gated_activation.c).
        self.native: NativeKernels | None = None

    def add_to(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """`residual + self(x)`, in `residual`'s memory (see Linear.add_to): the decoder
        layer's way in."""
        if self._fuses_activation(x.shape[0]):
            # The activation straight from the tile registers, in bf16 (the down product's
            # rows): the [rows, 2 * intermediate] product is never written out.
            gate_up = self.gate_up_proj
            activated = self.native.tiles_product(x, gate_up.compact, gate_up.bias, gated=True)
            return self.down_proj.add_to(activated, residual)
        return residual.add_(self(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[tokens, hidden] -> [tokens, hidden]."""
        if self._stays_in_bf16(x.shape[0]):
            return self._forward_in_bf16(x)
        gate_up = self.gate_up_proj(x)
        if self.native is not None:  # (set on float32 models only, so float32 rows)
            # One parallel pass, as the native decode step's: torch's silu and mul took 79 ms of
            # a 1024-token SmolLM2 prefill on the AMX Xeon (a strided gate, a temporary).
            return self.down_proj(self.native.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))

    def _fuses_activation(self, rows: int) -> bool:
        """Both products from bf16 tiles (AMX), whose gated epilogue takes whole tiles."""
        gate_up, down = self.gate_up_proj.compact, self.down_proj.compact
        return (
            self.native is not None
            and rows >= TILES_MIN_ROWS
            and gate_up is not None
            and down is not None
            and gate_up.tiles is not None
            and down.tiles is not None
            and gate_up.format == down.format == "bf16"
            and self.intermediate_size % 16 == 0
        )

    def _stays_in_bf16(self, rows: int) -> bool:
        gate_up, down = self.gate_up_proj, self.down_proj
        return (
            self.native is not None
            and gate_up.gemm_dtype == down.gemm_dtype == torch.bfloat16
            and gate_up.bias is None
            and down.bias is None
            and not gate_up.reads_compact(rows)
            and not down.reads_compact(rows)
        )

    def _forward_in_bf16(self, x: torch.Tensor) -> torch.Tensor:
        """The float32 path's values (its activation rounded to bf16 for the down GEMM, once)
        without widening the gate/up product to float32 and narrowing the activation back: a
        fifth of a 0.5B-shape prefill went to those casts."""
        out = torch.empty_like(x)
        for start in range(0, x.shape[0], MLP_BLOCK_ROWS):
            rows = x[start : start + MLP_BLOCK_ROWS].to(torch.bfloat16)
            gate_up = self.gate_up_proj.gemm_in_gemm_dtype(rows)
            activated = self.native.silu_mul_bf16(gate_up)
            out[start : start + MLP_BLOCK_ROWS] = self.down_proj.gemm_in_gemm_dtype(activated)
        return out
