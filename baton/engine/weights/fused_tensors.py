"""Checkpoint tensors that fuse projections Baton loads apart: Phi-3's q/k/v (`qkv_proj`) and
gate/up (`gate_up_proj`), cut by rows into the names every other architecture uses, so that
sharding over tensor-parallel ranks, pipeline stages and the fused layers' own row order treat
them alike."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TypeVar

import torch

from baton.checkpoint.model_config import ModelConfig
from baton.engine.native.formats import CompactWeight

FUSED_ARCHITECTURES = ("Phi3ForCausalLM",)

Stored = TypeVar("Stored", torch.Tensor, CompactWeight)


def unfused(
    config: ModelConfig, tensors: Iterable[tuple[str, Stored]]
) -> Iterator[tuple[str, Stored]]:
    """`tensors` with each fused projection cut into its parts (views of a tensor, copies of a
    stored weight's rows); anything else, and every tensor of other architectures, as it is."""
    if config.architecture not in FUSED_ARCHITECTURES:
        yield from tensors
        return
    parts = {
        "self_attn.qkv_proj.weight": (
            ("self_attn.q_proj.weight", config.q_size),
            ("self_attn.k_proj.weight", config.kv_size),
            ("self_attn.v_proj.weight", config.kv_size),
        ),
        "mlp.gate_up_proj.weight": (
            ("mlp.gate_proj.weight", config.intermediate_size),
            ("mlp.up_proj.weight", config.intermediate_size),
        ),
    }
    for name, value in tensors:
        prefix, _, suffix = name.partition(".layers.")
        layer, _, tail = suffix.partition(".")
        if tail not in parts:
            yield name, value
            continue
        start = 0
        for part, rows in parts[tail]:
            yield f"{prefix}.layers.{layer}.{part}", _rows(value, start, start + rows)
            start += rows


def _rows(value: Stored, start: int, end: int) -> Stored:
    if isinstance(value, CompactWeight):
        data = value.data[start:end].clone(memory_format=torch.contiguous_format)
        return CompactWeight(value.format, data, value.in_features)
    return value[start:end]
