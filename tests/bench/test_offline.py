"""The offline benchmark: exact length accounting, the transformers comparison, the shape cache."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import msgspec
import pytest
import torch
from safetensors import safe_open
from transformers import Qwen2ForCausalLM

from baton.bench.offline import main
from baton.bench.shapes import SHAPES, materialize_shape
from baton.checkpoint.load import load_checkpoint
from baton.cpu_binding import default_num_threads
from baton.engine.cpu.capabilities import detect_cpu_capabilities
from baton.hardware import CpuCapabilities

# Qwen2.5-0.5B's published parameter count (tied embeddings counted once).
QWEN25_05B_PARAMETERS = 494_032_768
# Keep the test engines' KV pools small (the default budget would zero-fill gigabytes), and the
# context within them.
SMALL_POOL = ["--num-gpu-blocks-override", "64", "--max-model-len", "1024"]


def run_bench(tmp_path: Path, *flags: str) -> dict:
    """Run the benchmark's main function; return what it wrote to --output-json."""
    output = tmp_path / "result.json"
    returned = main([*flags, *SMALL_POOL, "--output-json", str(output)])
    written = json.loads(output.read_text())
    assert written == json.loads(json.dumps(returned))
    return written


def test_fixed_lengths_generate_exactly_what_was_asked(
    tiny_qwen2_dir: Path, tmp_path: Path
) -> None:
    result = run_bench(
        tmp_path,
        *("--model", str(tiny_qwen2_dir), "--dtype", "float32"),
        *("--num-prompts", "16", "--random-input-len", "12", "--random-output-len", "30"),
        *("--random-range-ratio", "0"),
    )
    assert result["num_prompts"] == 16
    assert result["input_lens"] == [12] * 16
    assert result["output_lens"] == [30] * 16
    assert (result["total_input_tokens"], result["total_output_tokens"]) == (192, 480)
    baton = result["baton"]
    # Counted from the outputs: without ignore_eos, some of these greedy continuations of the
    # tiny model (EOS in its 259-token vocabulary) stop early.
    assert baton["output_tokens"] == 480
    assert baton["num_requests"] == 16
    assert baton["details"]["dtype"] == "float32"
    assert baton["details"]["disable_overlap"] is False
    assert baton["output_throughput"] == pytest.approx(480 / baton["elapsed_s"])
    assert baton["total_throughput"] == pytest.approx(672 / baton["elapsed_s"])
    assert "transformers" not in result


def test_transformers_gets_as_many_threads_as_batons_default_engine(
    tiny_qwen2_dir: Path, tmp_path: Path
) -> None:
    result = run_bench(
        tmp_path,
        *("--model", str(tiny_qwen2_dir), "--dtype", "float32", "--compare-hf"),
        *("--num-prompts", "2", "--random-input-len", "4", "--random-output-len", "3"),
    )
    threads = result["baton"]["details"]["num_threads"]
    assert threads == result["transformers"]["details"]["num_threads"] == default_num_threads()


def test_random_lengths_and_transformers_comparison(tmp_path: Path) -> None:
    # Prompts and outputs hold ids far above the bytes: the shape's tokenizer spells each one.
    result = run_bench(
        tmp_path,
        *("--shape", "tiny", "--cache-dir", str(tmp_path / "shapes")),
        *("--num-prompts", "5", "--random-input-len", "8", "--random-output-len", "6"),
        *("--random-range-ratio", "0.5", "--seed", "3"),
        *("--compare-hf", "--hf-batch-size", "4", "--num-threads", "1"),
    )
    input_lens, output_lens = result["input_lens"], result["output_lens"]
    assert all(4 <= n <= 12 for n in input_lens) and len(set(input_lens)) > 1
    assert all(3 <= n <= 9 for n in output_lens) and len(set(output_lens)) > 1
    assert result["total_output_tokens"] == sum(output_lens)
    baton, hf = result["baton"], result["transformers"]
    assert baton["output_tokens"] == hf["output_tokens"] == sum(output_lens)
    assert baton["details"]["num_threads"] == hf["details"]["num_threads"] == 1
    # The shape is stored in bf16; both engines compute in the dtype this CPU's plan chose:
    # float32, but bf16 on a native-bf16 CPU without the native kernels (no C compiler).
    bf16 = detect_cpu_capabilities().native_bf16 and shutil.which("cc") is None
    plan_dtype = "bfloat16" if bf16 else "float32"
    assert baton["details"]["dtype"] == baton["details"]["compute_plan"]["dtype"] == plan_dtype
    assert (hf["details"]["dtype"], hf["details"]["batch_size"]) == (plan_dtype, 4)
    # Every figure names the machine that made it.
    assert msgspec.convert(baton["details"]["cpu"], CpuCapabilities) == detect_cpu_capabilities()
    assert hf["details"]["wasted_tokens"] == hf_waste(output_lens, 4)
    assert result["baton_vs_transformers"] == pytest.approx(
        baton["output_throughput"] / hf["output_throughput"]
    )


def hf_waste(output_lens: list[int], batch_size: int) -> int:
    """Tokens static batching computes beyond the requests' own, longest-first batches."""
    ordered = sorted(output_lens, reverse=True)
    batches = [ordered[i : i + batch_size] for i in range(0, len(ordered), batch_size)]
    return sum(max(batch) * len(batch) - sum(batch) for batch in batches)


def test_model_and_shape_are_exclusive(tiny_qwen2_dir: Path) -> None:
    with pytest.raises(SystemExit):
        main(["--model", str(tiny_qwen2_dir), "--shape", "tiny"])


def test_shape_is_written_once_with_seeded_weights(tmp_path: Path) -> None:
    first = materialize_shape("tiny", tmp_path / "a", "bfloat16")
    written_at = (first / "model.safetensors").stat().st_mtime_ns
    assert materialize_shape("tiny", tmp_path / "a", "bfloat16") == first
    assert (first / "model.safetensors").stat().st_mtime_ns == written_at
    other = materialize_shape("tiny", tmp_path / "b", "bfloat16")
    assert (first / "model.safetensors").read_bytes() == (other / "model.safetensors").read_bytes()
    config = json.loads((first / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (
        256,
        4,
        32000,
    )
    with safe_open(str(first / "model.safetensors"), framework="pt") as tensors:
        names = set(tensors.keys())
        embedding = tensors.get_tensor("model.embed_tokens.weight")
    assert "lm_head.weight" not in names  # tied: stored once
    assert embedding.dtype == torch.bfloat16
    assert embedding.float().std().item() == pytest.approx(0.02, rel=0.05)
    assert {"tokenizer.json", "generation_config.json"} <= {p.name for p in first.iterdir()}
    # Every id the model can sample decodes to text (what streaming servers need to stream it).
    tokenizer = load_checkpoint(str(first)).tokenizer
    assert tokenizer.decode([259, 31999]) == " w259 w31999"


def test_unknown_shape_or_dtype_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown shape"):
        materialize_shape("no-such-shape", tmp_path, "bfloat16")
    with pytest.raises(ValueError, match="unsupported dtype"):
        materialize_shape("tiny", tmp_path, "int8")
    assert not any(tmp_path.iterdir())


def test_qwen25_shape_has_the_real_parameter_count() -> None:
    with torch.device("meta"):
        model = Qwen2ForCausalLM(SHAPES["qwen2.5-0.5b"].hf_config(torch.bfloat16))
    assert sum(p.numel() for p in model.parameters()) == QWEN25_05B_PARAMETERS
