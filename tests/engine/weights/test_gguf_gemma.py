"""Gemma 2 and Gemma 3 from GGUF files (llama.cpp's gemma2 and gemma3): the config read from
llama.cpp's metadata and its defaults, the norms llama.cpp stores as 1 + w, its names for the
norms around attention and the MLP; greedy tokens as transformers' on the weights the file
holds, past the window, in chunks, with prefix hits."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
from helpers import assert_greedy_matches_hf
from helpers.gguf_twins import dequantized_twin

from baton import LLM, SamplingParams
from baton.bench.gguf_export import export_gguf
from baton.checkpoint.gemma_config import FULL, SLIDING
from baton.checkpoint.gguf_config import hf_config
from baton.checkpoint.load import load_checkpoint
from baton.checkpoint.model_config import CheckpointError
from baton.engine.cpu.capabilities import detect_cpu_capabilities
from baton.engine.weights.checkpoint_tensors import iter_weights
from baton.hardware import isa_rank

VARIANTS = ("gemma2", "gemma3")
NATIVE = isa_rank(detect_cpu_capabilities().isa) >= isa_rank("avx2") and shutil.which("cc")
# llama.cpp scales a Gemma's attention by head_dim^-1/2 (but the 27B's): the tiny variants'
# query_pre_attn_scalar made to fit. A few unused ids past the tokenizer's 259 give the GGUF's
# one merge a place (gguf_export).
FITS_LLAMA_CPP = {"query_pre_attn_scalar": 32, "vocab_size": 300}
# Past the windows (16 and 8), the second within one chunk.
PROMPTS = [[(7 * j + 3) % 250 for j in range(45)], [(5 * j + 1) % 250 for j in range(11)]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def tiny_gemma(factory: Callable[..., Path], variant: str) -> Path:
    return factory(variant, **FITS_LLAMA_CPP)


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_file_holds_the_folders_config_and_weights(
    tiny_model_factory: Callable[..., Path], tmp_path: Path, variant: str
) -> None:
    """Windows per layer, soft caps, the attention's scalar, Gemma 3's local and (linearly
    scaled) global RoPE; the weights, the norms stored as 1 + w (as llama.cpp's converter
    writes them), under llama.cpp's names for those after attention and around the MLP."""
    model_dir = tiny_gemma(tiny_model_factory, variant)
    path = export_gguf(model_dir, "float32", tmp_path / "tiny.gguf", "F32")
    twin, loaded = load_checkpoint(str(model_dir)), load_checkpoint(str(path))
    for setting in ("architecture", "layer_windows", "gemma", "rope_theta", "rope_scaling"):
        assert getattr(loaded.config, setting) == getattr(twin.config, setting), setting
    stored = {tensor.name: tensor for tensor in gguf.GGUFReader(path).tensors}
    assert {"blk.0.post_attention_norm.weight", "blk.0.post_ffw_norm.weight"} <= stored.keys()
    expected = dict(iter_weights(twin))
    weights = dict(iter_weights(loaded))
    assert weights.keys() == expected.keys() - {"lm_head.weight"}
    for name, weight in weights.items():
        if not name.endswith("norm.weight"):
            assert np.array_equal(weight.numpy(), expected[name].numpy()), name
    # A norm scales by 1 + w: the file holds it (rounded to float32 once, as transformers
    # computes it), and loading gives back the very 1 + w the file holds.
    for gguf_name, hf_name in (
        ("blk.0.attn_norm.weight", "model.layers.0.input_layernorm.weight"),
        ("blk.0.post_attention_norm.weight", "model.layers.0.post_attention_layernorm.weight"),
        ("blk.1.ffn_norm.weight", "model.layers.1.pre_feedforward_layernorm.weight"),
        ("blk.1.post_ffw_norm.weight", "model.layers.1.post_feedforward_layernorm.weight"),
        ("output_norm.weight", "model.norm.weight"),
    ):
        held = np.asarray(stored[gguf_name].data)
        assert np.array_equal(held, expected[hf_name].numpy() + np.float32(1)), gguf_name
        assert np.array_equal(weights[hf_name].numpy() + np.float32(1), held), hf_name


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("tensor_type", ["F32", "Q8_0"])
def test_greedy_tokens_are_transformers_on_the_files_weights(
    tiny_model_factory: Callable[..., Path], tmp_path: Path, variant: str, tensor_type: str
) -> None:
    """Prompts past the window in chunks of 8 beside each other's decode rows; then one that
    shares the first prompt's head (a prefix-cache hit past the window)."""
    model_dir = tiny_gemma(tiny_model_factory, variant)
    path = export_gguf(model_dir, "float32", tmp_path / f"tiny-{tensor_type}.gguf", tensor_type)
    # F32 holds the folder's very weights; else the values the file's blocks stand for.
    reference = model_dir if tensor_type == "F32" else dequantized_twin(path, tmp_path / "twin")
    llm = LLM(str(path), dtype="float32", chunk_size=8, page_size=4)
    if NATIVE and tensor_type != "F32":  # (decode steps whole in C: norms, GeGLU, soft caps)
        assert llm.engine.decode_step is not None
    for prompt, output in zip(PROMPTS, llm.generate(PROMPTS, GREEDY)):
        assert len(output.token_ids) == GREEDY.max_tokens
        assert_greedy_matches_hf(reference, prompt, output.token_ids)
    again = [*PROMPTS[0][:40], 9, 8, 7]
    [output] = llm.generate([again], GREEDY)
    assert output.stats.cached_tokens >= 36  # past either window
    assert_greedy_matches_hf(reference, again, output.token_ids)


def minimal_gemma(
    target: Path,
    arch: str,
    layers: int,
    tokens: tuple[str, ...] = ("a", "<eos>"),
    types: tuple[int, ...] | None = None,
    **metadata: object,
) -> Path:
    """A GGUF holding only `arch`'s metadata (hidden 256, 8 heads of 64) and vocabulary:
    `metadata`'s keys after "<arch>.", the rest llama.cpp's defaults; token 1 its eos; `types`
    the tokens' llama.cpp types, if given."""
    writer = gguf.GGUFWriter(str(target), arch)
    writer.add_block_count(layers)
    writer.add_context_length(128)
    writer.add_embedding_length(256)
    writer.add_feed_forward_length(512)
    writer.add_head_count(8)
    writer.add_key_length(64)
    writer.add_token_list(list(tokens))
    if types is not None:
        writer.add_token_types(list(types))
    writer.add_eos_token_id(1)
    for key, value in metadata.items():
        add = {list: writer.add_array, str: writer.add_string, float: writer.add_float32}
        add.get(type(value), writer.add_uint32)(f"{arch}.{key}", value)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 256), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


def _config(path: Path) -> dict:
    return hf_config(gguf.GGUFReader(path), path)


def test_what_a_file_leaves_out_is_llama_cpps_default(tmp_path: Path) -> None:
    """Gemma 2: every second layer global, a window of 4096, soft caps 50 and 30. Gemma 3: every
    sixth layer global, local RoPE base 10000, no soft caps; without a window, every layer
    global. The 27B shapes (46 and 62 layers) scale attention by hidden / heads."""
    gemma2 = _config(minimal_gemma(tmp_path / "g2.gguf", "gemma2", 4))
    assert gemma2["layer_types"] == [SLIDING, FULL, SLIDING, FULL]
    assert gemma2["sliding_window"] == 4096
    assert (gemma2["attn_logit_softcapping"], gemma2["final_logit_softcapping"]) == (50.0, 30.0)
    assert gemma2["query_pre_attn_scalar"] == 64
    gemma3 = _config(
        minimal_gemma(tmp_path / "g3.gguf", "gemma3", 7, **{"attention.sliding_window": 512})
    )
    assert gemma3["layer_types"] == [SLIDING] * 5 + [FULL, SLIDING]
    assert gemma3["rope_parameters"][SLIDING]["rope_theta"] == 10000.0
    assert (gemma3["attn_logit_softcapping"], gemma3["final_logit_softcapping"]) == (None, None)
    unwindowed = _config(minimal_gemma(tmp_path / "g3-full.gguf", "gemma3", 7))
    assert unwindowed["layer_types"] == [FULL] * 7
    assert (
        _config(minimal_gemma(tmp_path / "27b.gguf", "gemma2", 46))["query_pre_attn_scalar"] == 32
    )


def test_a_pattern_of_flags_and_linear_scaling_are_read(tmp_path: Path) -> None:
    path = minimal_gemma(
        tmp_path / "g3.gguf",
        "gemma3",
        3,
        **{
            "attention.sliding_window": 64,
            "attention.sliding_window_pattern": [False, True, True],
            "rope.freq_base": 1e6,
            "rope.freq_base_swa": 5000.0,
            "rope.scaling.type": "linear",
            "rope.scaling.factor": 8.0,
        },
    )
    config = _config(path)
    assert config["layer_types"] == [FULL, SLIDING, SLIDING]
    # The scaling is the global layers' (as llama.cpp scales them alone).
    assert config["rope_parameters"] == {
        FULL: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        SLIDING: {"rope_type": "default", "rope_theta": 5000.0},
    }
    assert config["rope_scaling"] is None


def test_a_gemma_llama_cpp_cannot_express_is_not_exported(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    model_dir = tiny_model_factory("gemma2", vocab_size=300)  # query_pre_attn_scalar 24
    with pytest.raises(ValueError, match=r"scales this Gemma's attention by 32\^-1/2"):
        export_gguf(model_dir, "float32", tmp_path / "tiny.gguf", "F32")


def test_a_gemma2_with_its_own_local_rope_base_is_refused(tmp_path: Path) -> None:
    path = minimal_gemma(tmp_path / "g2.gguf", "gemma2", 2, **{"rope.freq_base_swa": 500.0})
    with pytest.raises(CheckpointError, match="Gemma 2 with its own local RoPE base"):
        _config(path)


def test_a_chat_ends_at_end_of_turn_though_the_file_names_eos_only(tmp_path: Path) -> None:
    """As llama.cpp: a token it ends generations at by its text (<end_of_turn>) stops one here
    too, beside the file's own eos id; but not a word of ordinary text that reads the same."""
    tokens = ("<pad>", "<eos>", "<bos>", "a", "<start_of_turn>", "<end_of_turn>", "</s>")
    control, normal = int(gguf.TokenType.CONTROL), int(gguf.TokenType.NORMAL)
    types = (control, control, control, normal, control, control, normal)
    path = minimal_gemma(tmp_path / "g2.gguf", "gemma2", 2, tokens, types)
    config = hf_config(gguf.GGUFReader(path), path)
    assert config["eos_token_id"] == [1, 5]


def test_what_llama_cpp_reads_differently_is_read_as_it_reads_it(tmp_path: Path) -> None:
    """A linear factor without a scaling type (or under the older key) scales, and a Gemma 3's
    attention soft cap is never applied: llama.cpp computes them so."""
    config = _config(
        minimal_gemma(
            tmp_path / "g3.gguf",
            "gemma3",
            2,
            **{"rope.scale_linear": 4.0, "attn_logit_softcapping": 20.0},
        )
    )
    assert config["rope_parameters"][FULL]["rope_type"] == "linear"
    assert config["rope_parameters"][FULL]["factor"] == 4.0
    assert config["attn_logit_softcapping"] is None


@pytest.mark.skipif(not NATIVE, reason="the native decode step: an AVX2 CPU and a compiler")
@pytest.mark.parametrize("variant", VARIANTS)
def test_the_native_step_gives_the_forwards_logprobs_and_samples(
    tiny_model_factory: Callable[..., Path], tmp_path: Path, variant: str
) -> None:
    """The one-call step (post-norms, GeGLU, soft caps, Gemma 3's local RoPE, in C) against the
    model's forward op by op (--enforce-eager): the same greedy tokens, logprobs of the
    soft-capped logits to 1e-5, and the same seeded samples."""
    model_dir = tiny_gemma(tiny_model_factory, variant)
    path = export_gguf(model_dir, "float32", tmp_path / "tiny.gguf", "Q8_0")
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
    sampled = SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=10, ignore_eos=True)
    outputs = {}
    for eager in (False, True):
        llm = LLM(str(path), dtype="float32", enforce_eager=eager)
        assert (llm.engine.decode_step is None) == eager
        outputs[eager] = llm.generate([PROMPTS[0], PROMPTS[1]], greedy) + llm.generate(
            [PROMPTS[1]], sampled
        )
    native, eager = outputs[False], outputs[True]
    assert [o.token_ids for o in native] == [o.token_ids for o in eager]
    for ours, theirs in zip(native[:2], eager[:2]):
        for a, b in zip(ours.logprobs, theirs.logprobs):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
            assert [token for token, _ in a.top] == [token for token, _ in b.top]
