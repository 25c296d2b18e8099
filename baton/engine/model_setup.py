"""The engine's model built on this machine: its memory asked of the machine first, then the
module made, its weights read (a GGUF's held as the file stores them, or loaded and kept once
more as stored for small batches), and given the kernels the compute plan chose: compact
weights, AMX or bf16 dot-product tiles, panels, the native attention and the packed GEMM
weights."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from baton.checkpoint.load import Checkpoint
from baton.checkpoint.model_config import ModelConfig
from baton.distributed.pipeline_parallel import PipelineParallel
from baton.distributed.tensor_parallel import TensorParallel
from baton.engine.memory_fit import (
    available_memory_bytes,
    check_fits,
    expected_weight_bytes,
    memory_in_use,
    return_freed_heap,
)
from baton.engine.models.causal_lm import CausalLM
from baton.engine.models.stored_weights import load_as_stored
from baton.engine.native.formats import COMPACT_MAX_ROWS
from baton.engine.native.library import NativeKernels
from baton.engine.weights.checkpoint_tensors import iter_compact_weights, iter_weights
from baton.hardware import ComputePlan

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelPlacement:
    """Where the model runs and how much of it this process holds: its device, its dtype and
    its GEMMs' (None: no GEMM in another dtype), this rank's and stage's parallel groups, the
    context it serves and, to ask the machine for, the bytes of its KV pool and the share of
    the weights it holds (tensor-parallel ranks times the stages' share of the layers)."""

    device: torch.device
    dtype: torch.dtype
    gemm_dtype: torch.dtype | None
    tp: TensorParallel
    pp: PipelineParallel
    context_length: int
    kv_pool_bytes: int
    weights_share: int


@dataclass(frozen=True)
class BuiltModel:
    """The loaded model, the linear layers that multiply in AMX or bf16 dot-product tiles, the
    native kernels that run its attention (None: torch's), and the bytes its weights took."""

    model: CausalLM
    tiled: int
    attention_kernels: NativeKernels | None
    weights_bytes: int


def build_model(
    model_config: ModelConfig,
    checkpoint: Checkpoint,
    plan: ComputePlan,
    native: NativeKernels | None,
    placement: ModelPlacement,
) -> BuiltModel:
    """The model of `checkpoint` on `placement`, with the kernels `plan` chose; a
    ConfigurationError, in one line and before any weight is read, where it does not fit this
    machine's memory."""
    dtype, device = placement.dtype, placement.device
    compact = native is not None and plan.compact_small_batches
    # (The compact kernels multiply float32 rows: a GGUF computed in bf16 is widened.)
    held_as_stored = checkpoint.gguf_file is not None and dtype == torch.float32
    if device.type == "cpu":
        element_bytes = torch.finfo(placement.gemm_dtype or dtype).bits // 8
        # Block formats' panels (AVX-512) and tiles (AMX): once more each.
        block_copies = int(native is not None and native.avx512) + int(plan.amx_tiles)
        weight_bytes = expected_weight_bytes(
            checkpoint, element_bytes, compact and held_as_stored, block_copies, stored_copy=compact
        )
        check_fits(
            -(-weight_bytes // placement.weights_share),
            placement.kv_pool_bytes,
            available_memory_bytes(),
        )
    memory_before_weights = memory_in_use(device)
    model = CausalLM(
        model_config,
        dtype,
        device,
        placement.gemm_dtype,
        placement.tp,
        placement.pp,
        context_length=placement.context_length,
    )
    tiled = 0
    if compact and held_as_stored:
        layers = load_as_stored(model, checkpoint, native)
        logger.info(
            "%d linear layers%s hold only the file's blocks: small batches multiply them in "
            "the compact kernels, larger ones a float32 slab at a time",
            layers,
            " and the embedding" if model.embedding_stored is not None else "",
        )
    else:
        model.load_weights(iter_weights(checkpoint, native))
    if compact:
        if not held_as_stored:
            stored = model.local_compact_weights(iter_compact_weights(checkpoint))
            attached = model.attach_compact_weights(stored, native)
            # (With bf16 GEMMs, start-up then times how many rows the layers keep: the
            # engine logs it.)
            logger.info(
                "%d linear layers read their stored weights in batches of up to %d rows",
                len(attached),
                COMPACT_MAX_ROWS,
            )
        tiled = _tile_compact_weights(model, plan, native)
        if native.avx512:
            panelled = model.panel_compact_weights(native)
            logger.info("%d linear layers multiply small batches in panels", panelled)
    # (The kernels read a KV cache of any --kv-cache-dtype, widening as they load.)
    float32_kernels = dtype == torch.float32 and model_config.head_dim % 8 == 0
    attention_kernels = native if float32_kernels else None
    if attention_kernels is not None:
        model.use_native_kernels(attention_kernels)
    if plan.pack_weights:
        model.pack_linear_weights()
    if device.type == "cpu":
        return_freed_heap()
    weights_bytes = memory_in_use(device) - memory_before_weights
    return BuiltModel(model, tiled, attention_kernels, weights_bytes)


def _tile_compact_weights(model: CausalLM, plan: ComputePlan, native: NativeKernels) -> int:
    """The linear layers the plan's tiles (AMX, else AVX512_BF16's dot products) now multiply
    batches of several rows in."""
    if plan.amx_tiles and not native.amx:
        logger.warning("this CPU has AMX, but Linux refused its tiles: no AMX here")
        return 0
    if plan.amx_tiles:
        tiled = model.tile_compact_weights(native)
        logger.info("%d linear layers multiply batches of several rows in AMX tiles", tiled)
        return tiled
    if plan.bf16_dot_tiles and native.bf16_dot:
        tiled = model.tile_compact_weights(native)
        logger.info(
            "%d linear layers multiply batches of several rows in bf16 dot products (AVX512_BF16)",
            tiled,
        )
        return tiled
    return 0
