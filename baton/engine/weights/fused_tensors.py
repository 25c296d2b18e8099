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


def _parts(config: ModelConfig) -> dict[str, tuple[tuple[str, int], ...]]:
    """A fused tensor's name (after "model.layers.N.") -> its parts' names and rows, in order."""
    return {
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


def part_names(config: ModelConfig, name: str) -> list[str]:
    """The names of a fused tensor's parts, or `name` alone for any other."""
    if config.architecture not in FUSED_ARCHITECTURES:
        return [name]
    head, layer, tail = _split(name)
    parts = _parts(config).get(tail)
    return [name] if parts is None else [f"{head}{layer}.{part}" for part, _ in parts]


def unfused(
    config: ModelConfig, tensors: Iterable[tuple[str, Stored]]
) -> Iterator[tuple[str, Stored]]:
    """`tensors` with each fused projection cut into its parts (views of a tensor, copies of a
    stored weight's rows); anything else, and every tensor of other architectures, as it is."""
    if config.architecture not in FUSED_ARCHITECTURES:
        yield from tensors
        return
    fused = _parts(config)
    for name, value in tensors:
        head, layer, tail = _split(name)
        if tail not in fused:
            yield name, value
            continue
        start = 0
        for part, rows in fused[tail]:
            yield f"{head}{layer}.{part}", _rows(value, start, start + rows)
            start += rows


def fused(
    config: ModelConfig, tensors: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The inverse of `unfused`: each fused projection's parts, wherever they come, put back
    together (as the checkpoint and llama.cpp's converter store them) once all are there."""
    if config.architecture not in FUSED_ARCHITECTURES:
        yield from tensors
        return
    fused_parts = _parts(config)
    whole_of = {part: tail for tail, parts in fused_parts.items() for part, _ in parts}
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, value in tensors:
        head, layer, tail = _split(name)
        if tail not in whole_of:
            yield name, value
            continue
        whole = f"{head}{layer}.{whole_of[tail]}"
        gathered = pending.setdefault(whole, {})
        gathered[tail] = value
        parts = [part for part, _ in fused_parts[whole_of[tail]]]
        if gathered.keys() == set(parts):
            del pending[whole]
            yield whole, torch.cat([gathered[part] for part in parts])


def _split(name: str) -> tuple[str, str, str]:
    """("model.layers.", "N", rest) of a layer's tensor name; (name, "", "") of another."""
    prefix, found, suffix = name.partition(".layers.")
    if not found:
        return name, "", ""
    layer, _, tail = suffix.partition(".")
    return f"{prefix}.layers.", layer, tail


def _rows(value: Stored, start: int, end: int) -> Stored:
    if isinstance(value, CompactWeight):
        data = value.data[start:end].clone(memory_format=torch.contiguous_format)
        return CompactWeight(value.format, data, value.in_features)
    return value[start:end]
