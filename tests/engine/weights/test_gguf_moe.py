"""Mixtures of experts from GGUF files (llama.cpp's qwen3moe, qwen2moe, and a "llama" with
experts for Mixtral): the stacked expert tensors split into each expert's weights, held in their
blocks and multiplied by the native expert kernel, greedy tokens as transformers' on the very
weights the file holds; the config read from llama.cpp's metadata."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import assert_greedy_matches_hf
from helpers.gguf_twins import dequantized_twin

from baton import LLM, SamplingParams
from baton.bench.gguf_export import export_gguf
from baton.checkpoint.load import load_checkpoint
from baton.engine.cpu.capabilities import detect_cpu_capabilities
from baton.engine.models.moe import SparseMoE
from baton.hardware import isa_rank

NATIVE = isa_rank(detect_cpu_capabilities().isa) >= isa_rank("avx2") and shutil.which("cc")
# llama.cpp's MoE architectures route in every layer, and renormalise the top-k weights of the
# models without a shared expert only: the tiny variants made to fit (64 expert features:
# whole blocks of Q8_0 and Q4_0).
VARIANTS = {
    "qwen3_moe": {"mlp_only_layers": [], "moe_intermediate_size": 64},
    "qwen2_moe": {
        "decoder_sparse_step": 1,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 96,
    },
    "mixtral": {"intermediate_size": 64},
}
PROMPTS = [[(7 * j + 3) % 250 for j in range(30)], [(5 * j + 1) % 250 for j in range(9)]]


def tiny_moe(factory: Callable[..., Path], variant: str) -> Path:
    # A few unused ids past the tokenizer's 259 give the GGUF's one merge a place (gguf_export).
    return factory(variant, vocab_size=300, **VARIANTS[variant])


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_config_comes_from_llama_cpp_metadata(
    tiny_model_factory: Callable[..., Path], tmp_path: Path, variant: str
) -> None:
    model_dir = tiny_moe(tiny_model_factory, variant)
    path = export_gguf(model_dir, "float32", tmp_path / "tiny.gguf", "F32")
    twin, loaded = load_checkpoint(str(model_dir)).config, load_checkpoint(str(path)).config
    assert loaded.architecture == twin.architecture
    assert loaded.moe == twin.moe


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("tensor_type", ["F32", "Q8_0", "Q4_0"])
def test_greedy_tokens_are_transformers_on_the_files_weights(
    tiny_model_factory: Callable[..., Path], tmp_path: Path, variant: str, tensor_type: str
) -> None:
    """Prompts in chunks of 8 beside each other's decode rows: batches route tokens of both
    requests, and a prefill chunk sends several rows to one expert. Block formats are held
    as stored, every expert's weights in the file's blocks (no float32 copy)."""
    model_dir = tiny_moe(tiny_model_factory, variant)
    path = export_gguf(model_dir, "float32", tmp_path / f"tiny-{tensor_type}.gguf", tensor_type)
    llm = LLM(str(path), dtype="float32", chunk_size=8, page_size=4)
    blocks = [layer.mlp for layer in llm.engine.model.layers]
    assert blocks and all(isinstance(block, SparseMoE) for block in blocks)
    if NATIVE and tensor_type != "F32":
        assert all(block.stored is not None for block in blocks)
        assert all(block.experts_gate_up.numel() == 0 for block in blocks)
        # Decode steps run whole in the native step (Qwen2-MoE's shared expert included).
        assert llm.engine.decode_step is not None
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    # F32 holds the folder's very weights; else the values the file's blocks stand for.
    reference = model_dir if tensor_type == "F32" else dequantized_twin(path, tmp_path / "twin")
    for prompt, output in zip(PROMPTS, llm.generate(PROMPTS, params)):
        assert len(output.token_ids) == 12
        assert_greedy_matches_hf(reference, prompt, output.token_ids)


def file_mappings(path: Path) -> list[tuple[int, int]]:
    """The address ranges where this process maps `path`."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith(str(path.resolve())):
            start, end = line.split()[0].split("-")
            ranges.append((int(start, 16), int(end, 16)))
    return ranges


FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "tiny-qwen3moe-Q4_K_M.gguf"


@pytest.mark.skipif(not NATIVE, reason="k-quants are held as stored: an AVX2 CPU and a compiler")
def test_a_llama_quantize_q4_k_m_moe_gives_transformers_tokens(tmp_path: Path) -> None:
    """llama.cpp's own quantizer's mix (tests/fixtures/README.md): experts in Q4_K and Q6_K,
    held in their blocks. (transformers' own GGUF loader misses the experts' width.)"""

    llm = LLM(str(FIXTURE), max_model_len=256, chunk_size=16)
    blocks = [layer.mlp for layer in llm.engine.model.layers]
    formats = [
        {weight.format for weight in block.stored.weights[2]} for block in blocks if block.stored
    ]
    assert formats == [{"q4_k"}, {"q6_k"}]  # each layer's down experts
    # The experts are read where the file is mapped, not copied.
    mapped = file_mappings(FIXTURE)
    for block in blocks:
        for weights in block.stored.weights:
            assert all(
                any(start <= w.data.data_ptr() < end for start, end in mapped) for w in weights
            )
    reference = dequantized_twin(FIXTURE, tmp_path / "twin")
    # The 40-token prompt is past the compact kernels' rows: its experts' chunks multiply the
    # blocks a float32 slab at a time (several of a chunk's rows to one expert).
    prompts = [[1, 2, 3, 4, 5], [40, 41, 42], [300 + i for i in range(40)], [100, 200, 50]]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for prompt, output in zip(prompts, llm.generate(prompts, params)):
        assert_greedy_matches_hf(reference, prompt, output.token_ids)


@pytest.mark.parametrize(
    "options",
    [
        {"disable_overlap": True},
        {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}},
    ],
    ids=["no-overlap", "ngram"],
)
def test_prefix_hits_preemption_and_the_engines_ways_keep_the_tokens(
    tiny_model_factory: Callable[..., Path], tmp_path: Path, options: dict
) -> None:
    """A Q8_0 Qwen3-MoE held as stored: a prompt from the prefix cache, requests preempted on
    a small pool and recomputed, with the overlap loop off or n-gram speculation (several rows
    of one request verified in a batch, routed together)."""
    model_dir = tiny_moe(tiny_model_factory, "qwen3_moe")
    path = export_gguf(model_dir, "float32", tmp_path / "tiny-Q8_0.gguf", "Q8_0")
    reference = dequantized_twin(path, tmp_path / "twin")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(str(path), dtype="float32", page_size=4, **options)
    prefix = PROMPTS[0][:24]
    for prompt in ([*prefix, 11, 12], [*prefix, 13, 14, 15]):
        [output] = llm.generate([prompt], params)
        assert_greedy_matches_hf(reference, prompt, output.token_ids)
    assert output.stats.cached_tokens >= 20
    crowded = LLM(
        str(path), dtype="float32", page_size=4, num_pages=24, max_model_len=64, **options
    )
    # Each request grows to 16 pages: two admitted on their prompts' 10 cannot both finish.
    prompts = [[(p * 17 + 3 * j) % 250 for j in range(40)] for p in range(4)]
    longer = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for prompt, output in zip(prompts, crowded.generate(prompts, longer)):
        assert_greedy_matches_hf(reference, prompt, output.token_ids)
    stats = crowded.scheduler.aggregate_stats()
    assert stats.preemptions > 0 and stats.used_pages == 0
