"""MKL's vector math, initialised before the engine's first elementwise math on several threads
(baton/engine/cpu/vector_math.py: what goes wrong otherwise, and how often)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import baton.engine.engine as engine_module
import baton.engine.models.layers as layers_module
from baton import LLM
from baton.engine.cpu.vector_math import initialize_vector_math


def test_the_engine_initialises_vector_math_before_it_builds_the_rope_tables(
    tiny_model_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[str] = []
    build_tables = layers_module.RotaryEmbedding.__init__

    def initialize() -> None:
        events.append("vector math")
        initialize_vector_math()

    def rotary_init(self, *args, **kwargs) -> None:
        events.append("rope tables")
        build_tables(self, *args, **kwargs)

    monkeypatch.setattr(engine_module, "initialize_vector_math", initialize)
    monkeypatch.setattr(layers_module.RotaryEmbedding, "__init__", rotary_init)
    llm = LLM(str(tiny_model_factory("llama")))
    assert events == ["vector math", "rope tables"]
    # The tables at VML's high accuracy (its EP mode, the failure, errs by up to 1.5e-4 here).
    rotary, config = llm.engine.model.rotary, llm.engine.model_config
    inv_freq = layers_module.rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
    positions = torch.arange(rotary.cos.shape[0], dtype=torch.float32)
    angles = torch.outer(positions, inv_freq).double()
    assert (rotary.cos.double() - angles.cos()).abs().max() < 1e-6
    assert (rotary.sin.double() - angles.sin()).abs().max() < 1e-6
