"""Phi-3 from GGUF files (llama.cpp's phi3): q/k/v and gate/up fused as llama.cpp stores them,
cut on load; the 128k models' LongRoPE factors, which llama.cpp stores as tensors, and their
attention factor; greedy tokens as transformers' on the weights the file holds."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from helpers import assert_greedy_matches_hf
from helpers.gguf_twins import dequantized_twin

from baton import LLM, SamplingParams
from baton.bench.gguf_export import export_gguf
from baton.checkpoint.gguf_config import hf_config
from baton.checkpoint.load import load_checkpoint
from baton.engine.weights.checkpoint_tensors import iter_compact_weights, iter_weights
from baton.engine.weights.gguf_names import hf_tensor_names

# A few unused ids past the tokenizer's 259 give the GGUF's one merge a place (gguf_export).
VOCAB = {"vocab_size": 300}
PROMPTS = [[(7 * j + 3) % 250 for j in range(30)], [(5 * j + 1) % 250 for j in range(9)]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def test_the_fused_tensors_are_stored_fused_and_loaded_cut(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    model_dir = tiny_model_factory("phi3", **VOCAB)
    path = export_gguf(model_dir, "float32", tmp_path / "tiny.gguf", "F32")
    twin, loaded = load_checkpoint(str(model_dir)), load_checkpoint(str(path))
    assert loaded.config.architecture == "Phi3ForCausalLM"
    assert loaded.config.rope_scaling is None
    config = twin.config
    stored = {tensor.name: tensor for tensor in gguf.GGUFReader(path).tensors}
    qkv_rows = config.q_size + 2 * config.kv_size
    assert tuple(stored["blk.0.attn_qkv.weight"].shape) == (config.hidden_size, qkv_rows)
    up_rows = 2 * config.intermediate_size
    assert tuple(stored["blk.0.ffn_up.weight"].shape) == (config.hidden_size, up_rows)
    assert "blk.0.attn_q.weight" not in stored
    expected, weights = dict(iter_weights(twin)), dict(iter_weights(loaded))
    assert weights.keys() == expected.keys()
    for name, weight in weights.items():
        assert torch.equal(weight, expected[name]), name


@pytest.mark.parametrize("tensor_type", ["F32", "Q8_0"])
def test_greedy_tokens_are_transformers_on_the_files_weights(
    tiny_model_factory: Callable[..., Path], tmp_path: Path, tensor_type: str
) -> None:
    """In chunks of 8 beside decode rows; a quantized file's fused blocks cut by rows and held
    as stored, where an unfused file's would be."""
    model_dir = tiny_model_factory("phi3", **VOCAB)
    path = export_gguf(model_dir, "float32", tmp_path / f"tiny-{tensor_type}.gguf", tensor_type)
    if tensor_type != "F32":
        held = dict(iter_compact_weights(load_checkpoint(str(path))))
        assert {"model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.up_proj.weight"} <= (
            held.keys()
        )
    reference = model_dir if tensor_type == "F32" else dequantized_twin(path, tmp_path / "twin")
    llm = LLM(str(path), dtype="float32", chunk_size=8, page_size=4)
    for prompt, output in zip(PROMPTS, llm.generate(PROMPTS, GREEDY)):
        assert len(output.token_ids) == GREEDY.max_tokens
        assert_greedy_matches_hf(reference, prompt, output.token_ids)


def test_longrope_factors_come_from_the_files_tensors(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """The factor sets (float32 tensors, as llama.cpp's converter writes them), the original
    context and the attention factor read back; served past the original context (long
    factors) and within it (short), tokens as transformers' on the file's weights."""
    model_dir = tiny_model_factory("phi3_longrope", **VOCAB)
    path = export_gguf(model_dir, "float32", tmp_path / "longrope.gguf", "F32")
    twin, loaded = load_checkpoint(str(model_dir)).config, load_checkpoint(str(path)).config
    stored = {tensor.name for tensor in gguf.GGUFReader(path).tensors}
    assert {"rope_factors_long.weight", "rope_factors_short.weight"} <= stored
    scaling, expected = loaded.rope_scaling, twin.rope_scaling
    assert scaling["rope_type"] == "longrope"  # type: ignore[index]
    for key in ("short_factor", "long_factor"):
        want = np.float32(expected[key])  # type: ignore[index]
        assert np.array_equal(np.float32(scaling[key]), want), key  # type: ignore[index]
    for key in ("original_max_position_embeddings", "attention_factor"):
        assert scaling[key] == pytest.approx(expected[key], rel=1e-6), key  # type: ignore[index]
    reference = dequantized_twin(path, tmp_path / "twin")
    long_prompt = [(11 * j + 5) % 250 for j in range(40)]  # past the original 32 positions
    [output] = LLM(str(path), dtype="float32", chunk_size=8, max_model_len=128).generate(
        [long_prompt], GREEDY
    )
    assert_greedy_matches_hf(reference, long_prompt, output.token_ids)
    short_prompt = long_prompt[:12]
    [output] = LLM(str(path), dtype="float32", max_model_len=32).generate(
        [short_prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    )
    assert_greedy_matches_hf(reference, short_prompt, output.token_ids)


def test_a_file_of_older_conventions_is_read_as_llama_cpp_reads_it(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """q, k and v apart (llama.cpp reads them so too), and LongRoPE factors without an attention
    factor, which llama.cpp takes as 1."""
    config = load_checkpoint(str(tiny_model_factory("phi3", **VOCAB))).config
    assert hf_tensor_names("blk.0.attn_q.weight", config) == [
        "model.layers.0.self_attn.q_proj.weight"
    ]
    assert hf_tensor_names("blk.0.ffn_up.weight", config) == [
        "model.layers.0.mlp.gate_up_proj.weight"
    ]
    path = tmp_path / "phi3.gguf"
    writer = gguf.GGUFWriter(str(path), "phi3")
    writer.add_block_count(1)
    writer.add_context_length(256)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_rope_scaling_orig_ctx_len(32)
    writer.add_token_list(["a", "b"])
    for name in ("rope_factors_long.weight", "rope_factors_short.weight"):
        writer.add_tensor(name, np.full(8, 2.0, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    scaling = hf_config(gguf.GGUFReader(path), path)["rope_scaling"]
    assert scaling["attention_factor"] == 1.0 and scaling["long_factor"] == [2.0] * 8
