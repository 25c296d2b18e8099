"""Phi-3: its fused q/k/v and gate/up tensors cut into the projections every architecture
loads, token for token as transformers, stored weights included; LongRoPE (the 128k
checkpoints) by one factor set per served model, chosen by the served context."""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import LONGROPE_FACTORS, assert_greedy_matches_hf
from transformers import AutoConfig
from transformers.modeling_rope_utils import _compute_longrope_parameters

from baton import LLM, SamplingParams
from baton.checkpoint.load import load_checkpoint
from baton.checkpoint.model_config import CheckpointError, ModelConfig
from baton.engine.models.layers import RotaryEmbedding, rope_inv_freq
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


# --- LongRoPE (the 128k checkpoints): 32 original positions of 256 in the tiny variant --------

SHORT_PROMPTS = [[(11 * j + 2) % 250 for j in range(20)], [(5 * j + 1) % 250 for j in range(9)]]
# Past the original 32 positions from the prompt on: transformers rotates such a sequence by
# its long factors throughout.
LONG_PROMPTS = [[(7 * j + 3) % 250 for j in range(40)], [(13 * j + 5) % 250 for j in range(34)]]


def _serve(model_dir: Path, max_model_len: int, **options: object) -> LLM:
    return LLM(str(model_dir), dtype="float32", max_model_len=max_model_len, page_size=4, **options)


def _logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("LongRoPE")]


def test_longrope_within_the_original_context_rotates_by_the_short_factors(
    tiny_model_factory: Callable[..., Path], caplog: pytest.LogCaptureFixture
) -> None:
    """Served with at most the original 32 positions, every sequence (prompt and output within
    them, as transformers then rotates by the short factors) is transformers' token for
    token."""
    model_dir = tiny_model_factory("phi3_longrope")
    with caplog.at_level(logging.INFO, logger="baton.engine.models.causal_lm"):
        llm = _serve(model_dir, 32, chunk_size=8)
    assert _logged(caplog) == [
        "LongRoPE: the short factors, for every sequence: the served context 32 is within the "
        "original 32 positions (attention factor 1.2649)"
    ]
    for prompt, output in zip(SHORT_PROMPTS, llm.generate(SHORT_PROMPTS, GREEDY)):
        assert len(prompt) + len(output.token_ids) <= 32
        assert_greedy_matches_hf(model_dir, prompt, output.token_ids)


@pytest.mark.parametrize(
    ("disable_overlap", "weights_dtype"),
    [(False, torch.float32), (True, torch.float32), (False, torch.bfloat16)],
)
def test_longrope_past_the_original_context_rotates_by_the_long_factors(
    tiny_model_factory: Callable[..., Path],
    caplog: pytest.LogCaptureFixture,
    disable_overlap: bool,
    weights_dtype: torch.dtype,
) -> None:
    """Served past the original context, prompts longer than it, prefilled in chunks of 8
    beside decode rows, are transformers' token for token, overlapped steps or not; bf16
    weights computed in float32 decode in the one-call native step, which reads the same
    tables."""
    model_dir = tiny_model_factory("phi3_longrope", weights_dtype=weights_dtype)
    with caplog.at_level(logging.INFO, logger="baton.engine.models.causal_lm"):
        llm = _serve(model_dir, 128, chunk_size=8, disable_overlap=disable_overlap)
    assert _logged(caplog) == [
        "LongRoPE: the long factors, for every sequence: the served context 128 exceeds the "
        "original 32 positions (attention factor 1.2649)"
    ]
    if weights_dtype == torch.bfloat16:
        assert llm.engine.decode_step is not None
    for prompt, output in zip(LONG_PROMPTS, llm.generate(LONG_PROMPTS, GREEDY)):
        assert_greedy_matches_hf(model_dir, prompt, output.token_ids)


def test_the_factor_set_matters(tiny_model_factory: Callable[..., Path]) -> None:
    """Each set's tables are transformers' bit for bit (inverse frequencies, and cos/sin times
    the attention factor), the two sets' differ, and short prompts rotated by the long set
    (as a model served past the original context rotates them) leave transformers' tokens,
    which rotate them by the short set: a wrong choice would show."""
    model_dir = tiny_model_factory("phi3_longrope")
    config = load_checkpoint(str(model_dir)).config
    hf_config = AutoConfig.from_pretrained(model_dir)
    tables = {}
    for context, seq_len in ((32, 32), (128, 33)):
        inv_freq, attention = _compute_longrope_parameters(hf_config, seq_len=seq_len)
        assert attention == config.rope_scaling["attention_factor"] == pytest.approx(1.2649, 1e-4)
        ours = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling, context)
        assert torch.equal(ours, inv_freq)
        rotary = RotaryEmbedding(
            config.head_dim,
            256,
            config.rope_theta,
            config.rope_scaling,
            torch.float32,
            "cpu",
            context,
        )
        angles = torch.arange(256, dtype=torch.float32)[:, None] * inv_freq
        assert torch.equal(rotary.cos, angles.cos() * attention)
        assert torch.equal(rotary.sin, angles.sin() * attention)
        tables[context] = rotary.cos
    assert not torch.allclose(tables[32][1:], tables[128][1:], atol=1e-2)
    outputs = _serve(model_dir, 128).generate(SHORT_PROMPTS, GREEDY)
    with pytest.raises(AssertionError, match="transformers prefers"):
        for prompt, output in zip(SHORT_PROMPTS, outputs):
            assert_greedy_matches_hf(model_dir, prompt, output.token_ids)


def _legacy_config(model_dir: Path) -> dict:
    """The folder's config.json as Phi-3-mini-128k's is written: `rope_scaling` with `type`
    and the factor lists, rope_theta and original_max_position_embeddings at the top level."""
    config = json.loads((model_dir / "config.json").read_text())
    config.pop("rope_parameters")
    config["rope_theta"] = 10000.0
    config["rope_scaling"] = {"type": "longrope", **LONGROPE_FACTORS}
    return config


def test_both_config_styles_load_alike(tiny_model_factory: Callable[..., Path]) -> None:
    model_dir = tiny_model_factory("phi3_longrope")
    new_style = json.loads((model_dir / "config.json").read_text())
    assert new_style["rope_parameters"]["rope_type"] == "longrope"
    legacy = _legacy_config(model_dir)
    parsed = ModelConfig.from_hf(new_style)
    assert ModelConfig.from_hf(legacy) == parsed
    assert parsed.rope_scaling == ModelConfig.from_hf(legacy).rope_scaling
    assert parsed.rope_scaling == {
        "rope_type": "longrope",
        **LONGROPE_FACTORS,
        "original_max_position_embeddings": 32,
        "attention_factor": pytest.approx(math.sqrt(1 + math.log(8) / math.log(32))),
    }
    # Phi-3's first name for it; an explicit attention factor wins over the default.
    su = {**legacy, "rope_scaling": {**legacy["rope_scaling"], "type": "su"}}
    assert ModelConfig.from_hf(su) == parsed
    explicit = {**legacy, "rope_scaling": {**legacy["rope_scaling"], "attention_factor": 1.5}}
    assert ModelConfig.from_hf(explicit).rope_scaling["attention_factor"] == 1.5


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"short_factor": [1.0] * 7}, "short_factor must be a list of 8 numbers > 0"),
        ({"long_factor": [1.0] * 7 + [0.0]}, "long_factor must be a list of 8 numbers > 0"),
        ({"long_factor": None}, "long_factor must be a list of 8 numbers > 0"),
        ({"short_factor": [1.0] * 7 + [True]}, "short_factor must be a list of 8 numbers > 0"),
        ({"original_max_position_embeddings": 0}, "must be a positive integer, got 0"),
        ({"original_max_position_embeddings": "32"}, "must be a positive integer, got '32'"),
        ({"attention_factor": -1.0}, "attention_factor must be a number > 0, got -1.0"),
        ({"factor": 0}, "factor must be a number > 0, got 0"),
        ({"partial_rotary_factor": 0.75}, "partial rotary embeddings are not supported"),
    ],
)
def test_invalid_longrope_configs_are_refused(
    tiny_model_factory: Callable[..., Path], change: dict, message: str
) -> None:
    config = _legacy_config(tiny_model_factory("phi3_longrope"))
    if "original_max_position_embeddings" in change:  # (the top-level one wins)
        config["original_max_position_embeddings"] = change["original_max_position_embeddings"]
    config["rope_scaling"].update(change)
    with pytest.raises(CheckpointError, match=rf"^config\.json: .*{re.escape(message)}"):
        ModelConfig.from_hf(config)
