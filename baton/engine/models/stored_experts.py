"""A mixture-of-experts model's experts held as the checkpoint stores them: each expert's gate,
up and down weights in their GGUF blocks (or bf16, f16), multiplied by the native expert kernel
(native/layer/moe_experts.c) in batches of every size, with no float32 copy.

A Qwen3-30B-A3B's experts are 29 of its 30.5B parameters: as float32 they would take 116 GB,
as Q4_K_M blocks 17 GB, and a token reads only its 8 of each layer's 128.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

import torch
from torch import nn

from baton.checkpoint.model_config import ModelConfig
from baton.engine.models.moe import SparseMoE
from baton.engine.native.formats import CompactWeight
from baton.engine.native.library import NativeKernels
from baton.engine.native.structs import ExpertMatrices

logger = logging.getLogger(__name__)


def hold_stored_experts(
    config: ModelConfig,
    layers: Iterable[tuple[int, nn.Module]],
    stored: Mapping[str, CompactWeight],
    native: NativeKernels,
) -> set[str]:
    """Give each float32 mixture-of-experts layer of `layers` ((checkpoint index, decoder
    layer) pairs) whose every expert is in `stored` those weights, freeing its stacked float32
    ones; the names held (which the caller then does not read as float32)."""
    moe = config.moe
    held: set[str] = set()
    if moe is None:
        return held
    holding, count = 0, moe.num_experts
    hidden, features = config.hidden_size, moe.expert_intermediate_size
    for layer, decoder_layer in layers:
        block = decoder_layer.mlp
        if not isinstance(block, SparseMoE) or block.experts_gate_up.dtype != torch.float32:
            continue
        first, count = block.held  # (this rank's experts)
        names = [moe.expert_weight_names(layer, e) for e in range(first, first + count)]
        if any(name not in stored for triple in names for name in triple):
            continue
        gate, up, down = ([stored[triple[i]] for triple in names] for i in range(3))
        shapes = {
            (w.out_features, w.in_features, i == 2)
            for i, ws in enumerate((gate, up, down))
            for w in ws
        }
        if shapes != {(features, hidden, False), (hidden, features, True)}:
            continue  # (not this block's experts: it keeps its float32 ones)
        block.hold_stored_experts(ExpertMatrices(gate, up, down, native.avx512), native)
        held.update(name for triple in names for name in triple)
        holding += 1
    if holding:
        share = "" if count == moe.num_experts else f" ({count} of {moe.num_experts} on this rank)"
        logger.info(
            "%d mixture-of-experts layers multiply their experts as stored%s", holding, share
        )
    return held
