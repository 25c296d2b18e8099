"""GGUF checkpoints: tiny models written with the `gguf` package load as their safetensors twins,
and bad files fail in one line."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from helpers import hf_greedy_generate

from baton import LLM, SamplingParams
from baton.bench.gguf_export import export_gguf
from baton.checkpoint.gguf_metadata import converted_folder, gguf_cache_root
from baton.checkpoint.load import load_checkpoint
from baton.checkpoint.model_config import CheckpointError, ModelConfig
from baton.checkpoint.source import load_model_config
from baton.engine.weights.checkpoint_tensors import iter_weights
from baton.engine.weights.gguf_names import (
    permute_rows,
    permuted_heads,
    unpermute_rows,
)


def _tiny(factory: Callable[..., Path], variant: str) -> Path:
    """The tiny variant (the llama with its Llama 3 RoPE scaling, which its GGUF stores as
    llama.cpp does: a rope_freqs tensor)."""
    # A few unused ids past the tokenizer's 259 give the GGUF's one merge a place (gguf_export).
    return factory(variant, vocab_size=300)


def _write(model_dir: Path, target: Path, tensor_type: str) -> Path:
    return export_gguf(model_dir, "float32", target, tensor_type)


def _stored_values(weight: torch.Tensor, tensor_type: str, heads: int | None) -> np.ndarray:
    """What a GGUF of `tensor_type` holds for `weight`, dequantized, in HF's row order; `heads`
    for a llama q/k weight, whose rows llama.cpp stores permuted."""
    values = weight.to(torch.float32).numpy()
    if values.ndim == 1 or tensor_type == "F32":
        return values  # 1-D tensors stay F32
    quant = getattr(gguf.GGMLQuantizationType, tensor_type)
    stored = permute_rows(values, heads) if heads else values
    round_trip = gguf.quants.dequantize(gguf.quants.quantize(stored, quant), quant)
    return unpermute_rows(round_trip, heads) if heads else round_trip


@pytest.mark.parametrize("variant", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("tensor_type", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_a_gguf_loads_the_weights_of_its_safetensors_twin(
    tiny_model_factory: Callable[..., Path], tmp_path: Path, variant: str, tensor_type: str
) -> None:
    model_dir = _tiny(tiny_model_factory, variant)
    path = _write(model_dir, tmp_path / f"tiny-{tensor_type}.gguf", tensor_type)
    twin = load_checkpoint(str(model_dir))
    checkpoint = load_checkpoint(str(path))
    assert checkpoint.name == f"tiny-{tensor_type}"
    assert checkpoint.config.architecture == twin.config.architecture
    assert checkpoint.config.torch_dtype == "float32"  # computed as llama.cpp does
    assert checkpoint.eos_token_ids == twin.config.eos_token_ids[:1]
    loaded = dict(iter_weights(checkpoint))
    expected = dict(iter_weights(twin))
    if twin.config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    assert loaded.keys() == expected.keys()
    config = twin.config
    for name, weight in expected.items():
        heads = permuted_heads(name, config.num_heads, config.num_kv_heads)
        heads = heads if variant == "llama" else 0
        # F32 exactly; other types exactly as their own quantization round trip gives them.
        assert np.array_equal(loaded[name].numpy(), _stored_values(weight, tensor_type, heads))


@pytest.mark.parametrize("variant", ["llama", "qwen3"])
def test_greedy_tokens_from_an_f32_gguf_equal_the_safetensors_ones(
    tiny_model_factory: Callable[..., Path], tmp_path: Path, variant: str
) -> None:
    """End to end: the tokenizer converted from the GGUF spells prompts as the original does,
    and llama's un-permuted q/k rows compute the same attention."""
    model_dir = _tiny(tiny_model_factory, variant)
    path = _write(model_dir, tmp_path / "tiny.gguf", "F32")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = ["Once upon a time", "The little dog ran"]
    from_gguf = LLM(str(path), dtype="float32").generate(prompts, params)
    from_folder = LLM(str(model_dir), dtype="float32").generate(prompts, params)
    assert [o.token_ids for o in from_gguf] == [o.token_ids for o in from_folder]


def test_a_llama3_gguf_with_rope_freqs_decodes_as_transformers_does(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """A Llama 3.1-style GGUF (its RoPE scaling as llama.cpp's `rope_freqs` factors): Baton
    divides each frequency by its factor, as llama.cpp does, and decodes token for token as
    transformers does from the HF twin with its llama3 scaling, past the original context."""
    model_dir = _tiny(tiny_model_factory, "llama")
    path = _write(model_dir, tmp_path / "llama3.gguf", "F32")
    config = load_checkpoint(str(path)).config
    factors = config.rope_scaling["factors"]  # type: ignore[index]
    assert config.rope_scaling["rope_type"] == "freq_factors"  # type: ignore[index]
    # All three bands occur: kept (1), stretched (the factor, 8) and blended between.
    assert 1.0 in factors and 8.0 in factors and any(1.0 < f < 8.0 for f in factors)
    prompt = [(7 * i) % 250 + 3 for i in range(70)]  # longer than the original 64 positions
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    [output] = LLM(str(path), dtype="float32").generate([prompt], params)
    assert output.token_ids == hf_greedy_generate(model_dir, prompt, 20)


def test_rope_freq_factors_that_do_not_fit_are_named_in_one_line() -> None:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 300,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "max_position_embeddings": 128,
        "rope_scaling": {"rope_type": "freq_factors", "factors": [1.0, 2.0]},  # head_dim 8: 4
    }
    with pytest.raises(CheckpointError, match="must be 4 numbers > 0"):
        ModelConfig.from_hf(config)


def test_the_metadata_is_converted_once(
    tiny_model_factory: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "own-cache"))  # this file's alone
    path = _write(_tiny(tiny_model_factory, "qwen2"), tmp_path / "tiny.gguf", "F32")
    config = load_model_config(str(path))
    [folder] = [entry for entry in gguf_cache_root().iterdir() if entry.is_dir()]
    assert (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file()
    stamp = (folder / "config.json").stat().st_mtime_ns
    assert load_checkpoint(str(path)).config == config
    assert (folder / "config.json").stat().st_mtime_ns == stamp  # read, not rewritten


def test_a_truncated_gguf_is_one_line(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    path = _write(_tiny(tiny_model_factory, "qwen2"), tmp_path / "tiny.gguf", "F32")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(path.read_bytes()[:5000])
    with pytest.raises(CheckpointError, match="not a readable GGUF file") as error:
        load_checkpoint(str(truncated))
    assert "\n" not in str(error.value) and str(truncated) in str(error.value)


def _gguf_with(target: Path, arch: str, tensor_type: gguf.GGMLQuantizationType) -> Path:
    """A minimal GGUF: `arch`'s metadata and one 2-D tensor stored as `tensor_type`."""
    writer = gguf.GGUFWriter(str(target), arch)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(256)
    writer.add_feed_forward_length(256)
    writer.add_head_count(4)
    writer.add_token_list(["a", "b"])
    block_size, type_size = gguf.GGML_QUANT_SIZES[tensor_type]
    raw = np.zeros((2, 256 // block_size * type_size), dtype=np.uint8)
    writer.add_tensor("token_embd.weight", raw, raw_dtype=tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


@pytest.mark.parametrize(
    ("arch", "tensor_type", "expected"),
    [
        (
            "gpt2",
            gguf.GGMLQuantizationType.Q8_0,
            "GGUF architecture 'gpt2' is not supported (supported: llama, qwen2, qwen3, qwen2moe, "
            "qwen3moe, gemma2, gemma3, phi3)",
        ),
        (
            "llama",
            gguf.GGMLQuantizationType.Q8_K,
            "tensor 'token_embd.weight' is stored as Q8_K, which cannot be dequantized",
        ),
    ],
    ids=["architecture", "storage-type"],
)
def test_what_baton_cannot_load_is_named_in_one_line(
    tmp_path: Path, arch: str, tensor_type: gguf.GGMLQuantizationType, expected: str
) -> None:
    path = _gguf_with(tmp_path / "model.gguf", arch, tensor_type)
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(str(path))
    assert expected in str(error.value)
    assert "\n" not in str(error.value)


def test_missing_metadata_is_named_in_one_line(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(str(tmp_path / "bare.gguf"), "llama")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((2, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(str(tmp_path / "bare.gguf"))
    assert str(error.value).endswith(
        "GGUF metadata lacks llama.context_length, llama.embedding_length, "
        "llama.feed_forward_length, llama.attention.head_count"
    )


def test_an_unwritable_cache_is_named_in_one_line(
    tiny_model_factory: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _write(_tiny(tiny_model_factory, "qwen2"), tmp_path / "tiny.gguf", "F32")
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(not_a_folder))
    with pytest.raises(CheckpointError, match="cannot write its converted metadata") as error:
        load_checkpoint(str(path))
    assert "\n" not in str(error.value)


CONVERT_IN_A_LEAN_PROCESS = """
import sys
from pathlib import Path
from baton.checkpoint.gguf_metadata import converted_folder
from baton.checkpoint.model_config import CheckpointError, ModelConfig
try:
    print(converted_folder(Path(sys.argv[1])))
except CheckpointError as error:
    print("error:", error)
assert "transformers" not in sys.modules and "torch" not in sys.modules
"""


def _convert_in_a_lean_process(path: Path) -> str:
    """What `converted_folder` prints in a process that never imports transformers (as the
    frontend and the tokenizer process): the folder, or "error: ..."."""
    done = subprocess.run(
        [sys.executable, "-c", CONVERT_IN_A_LEAN_PROCESS, str(path)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return done.stdout.strip()


def test_the_tokenizer_converts_alike_with_and_without_transformers_loaded(
    tiny_model_factory: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process holding transformers converts in place; one without it converts in a
    subprocess and stays free of torch. The files are the same."""
    path = _write(_tiny(tiny_model_factory, "llama"), tmp_path / "tiny.gguf", "F32")
    assert "transformers" in sys.modules
    in_place = converted_folder(path)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "lean-cache"))
    lean = Path(_convert_in_a_lean_process(path))
    assert lean.is_relative_to(tmp_path / "lean-cache") and lean.name == in_place.name
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (lean / name).read_text() == (in_place / name).read_text(), name


def test_a_tokenizer_that_cannot_be_converted_is_one_line_either_way(
    tiny_model_factory: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = _write(_tiny(tiny_model_factory, "llama"), tmp_path / "tiny.gguf", "F32")
    key = b"tokenizer.ggml.model"
    model = gguf.GGUFReader(source).fields[key.decode()].contents().encode()
    data = bytearray(source.read_bytes())
    at = data.index(model, data.index(key) + len(key))
    # A name of the same length: the layout stays valid, the tokenizer model is unknown.
    data[at : at + len(model)] = b"?" * len(model)
    broken = tmp_path / "odd-tokenizer.gguf"
    broken.write_bytes(data)
    with pytest.raises(CheckpointError, match="cannot build its tokenizer") as error:
        converted_folder(broken)
    assert "\n" not in str(error.value)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "lean-cache"))
    lean = _convert_in_a_lean_process(broken)
    assert lean.startswith(f"error: {broken.resolve()}: cannot build its tokenizer: ")
    assert "\n" not in lean
