"""Phi-3: its fused q/k/v and gate/up tensors cut into the projections every architecture
loads, token for token as transformers, stored weights included."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import assert_greedy_matches_hf

from baton import LLM, SamplingParams
from baton.checkpoint.load import load_checkpoint
from baton.engine.weights.checkpoint_tensors import iter_compact_weights, iter_weights

PROMPTS = [[(7 * j + 3) % 250 for j in range(30)], [(5 * j + 1) % 250 for j in range(9)]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def test_the_fused_tensors_are_cut_into_the_usual_names(
    tiny_model_factory: Callable[..., Path],
) -> None:
    checkpoint = load_checkpoint(str(tiny_model_factory("phi3")))
    config = checkpoint.config
    names = dict(iter_weights(checkpoint))
    assert not any("qkv_proj" in name or "gate_up_proj" in name for name in names)
    shapes = {
        "self_attn.q_proj.weight": (config.q_size, config.hidden_size),
        "self_attn.k_proj.weight": (config.kv_size, config.hidden_size),
        "self_attn.v_proj.weight": (config.kv_size, config.hidden_size),
        "mlp.gate_proj.weight": (config.intermediate_size, config.hidden_size),
        "mlp.up_proj.weight": (config.intermediate_size, config.hidden_size),
    }
    for part, shape in shapes.items():
        assert tuple(names[f"model.layers.1.{part}"].shape) == shape


@pytest.mark.parametrize("weights_dtype", [torch.float32, torch.bfloat16])
def test_greedy_tokens_are_transformers(
    tiny_model_factory: Callable[..., Path], weights_dtype: torch.dtype
) -> None:
    """In chunks of 8 beside decode rows; bf16 weights computed in float32 (their stored
    values cut by rows as the float32 ones are) against transformers on the same weights."""
    model_dir = tiny_model_factory("phi3", weights_dtype=weights_dtype)
    llm = LLM(str(model_dir), dtype="float32", chunk_size=8, page_size=4)
    for prompt, output in zip(PROMPTS, llm.generate(PROMPTS, GREEDY)):
        assert_greedy_matches_hf(model_dir, prompt, output.token_ids)
    if weights_dtype == torch.bfloat16:
        stored = dict(iter_compact_weights(load_checkpoint(str(model_dir))))
        assert "model.layers.0.self_attn.q_proj.weight" in stored
        assert "model.layers.0.mlp.up_proj.weight" in stored
        layer = llm.engine.model.layers[0]
        # The fused layers hold their stored parts exactly where an unfused layer does.
        held = layer.self_attn.o_proj.compact is not None
        assert (layer.self_attn.qkv_proj.compact is not None) == held
        assert (layer.mlp.gate_up_proj.compact is not None) == held
