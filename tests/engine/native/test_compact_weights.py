"""Small batches multiply the weights as stored (bf16, f16, GGUF blocks) with the native kernel:
its arithmetic, which layers get compact weights, and greedy tokens end to end."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers.compact_reference import (
    SCALE_OFFSETS,
    assert_float32_sums,
    check_against_float64,
    random_blocks,
    stored_weight,
)
from helpers.hf_reference import hf_greedy_generate
from helpers.native_cache import use_private_cache

from baton import LLM, SamplingParams
from baton.bench.gguf_export import export_gguf
from baton.checkpoint.load import load_checkpoint
from baton.engine.cpu.capabilities import detect_cpu_capabilities
from baton.engine.models.causal_lm import CausalLM
from baton.engine.models.layers import Linear
from baton.engine.native.formats import (
    BLOCK_FORMATS,
    COMPACT_MAX_ROWS,
    FORMATS,
    PARTS,
    STAGED_FORMATS,
    STORED_MAX_ROWS,
    CompactWeight,
)
from baton.engine.native.library import NativeBuildError, NativeKernels, load_native_kernels
from baton.engine.weights.checkpoint_tensors import iter_compact_weights, iter_weights
from baton.hardware import isa_rank

pytestmark = pytest.mark.skipif(
    isa_rank(detect_cpu_capabilities().isa) < isa_rank("avx2") or shutil.which("cc") is None,
    reason="the native kernel needs an AVX2 CPU and a C compiler",
)


@pytest.fixture(autouse=True)
def private_cache(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Converted GGUF metadata goes to a cache of the tests' own (helpers.native_cache)."""
    use_private_cache(tmp_path_factory, monkeypatch)


@pytest.fixture(params=[False, True], ids=["avx2", "avx512"])
def native(request: pytest.FixtureRequest) -> NativeKernels:
    """The kernels with each vector width this CPU runs (AVX-512's from two rows)."""
    if request.param and isa_rank(detect_cpu_capabilities().isa) < isa_rank("avx512"):
        pytest.skip("this CPU (or its ISA cap) has no AVX-512")
    return load_native_kernels(avx512=request.param)


def whole_blocks(width: int, compact_format: str) -> int:
    """`width` rounded up to whole blocks of the format (256 weights for the k-quants)."""
    block = FORMATS[compact_format].block
    return -(-width // block) * block


@pytest.mark.parametrize("compact_format", sorted(FORMATS))
def test_the_kernel_reads_each_weight_as_exactly_its_float32_value(
    native: NativeKernels, compact_format: str
) -> None:
    width = whole_blocks(96, compact_format)
    weight = np.random.default_rng(0).normal(size=(40, width)).astype(np.float32)
    compact, values = stored_weight(weight, compact_format)
    # One-hot rows pick single weights: no sum, so any difference is in the dequantization.
    assert torch.equal(native.gemv(torch.eye(width), compact, None), values.T)


@pytest.mark.parametrize("compact_format", sorted(FORMATS))
def test_dequantizing_gives_exactly_the_stored_values(
    native: NativeKernels, compact_format: str
) -> None:
    """What loading a GGUF uses: the whole matrix, bit for bit what gguf's numpy code gives."""
    weight = np.random.default_rng(1).normal(size=(40, whole_blocks(96, compact_format)))
    compact, values = stored_weight(weight.astype(np.float32), compact_format)
    assert torch.equal(native.dequantize(compact), values)
    # An embedding's lookups: any rows, in any order, repeated.
    ids = torch.tensor([39, 0, 7, 7])
    assert torch.equal(native.dequantize_rows(compact, ids), values[ids])


@pytest.mark.parametrize("compact_format", sorted(FORMATS))
@pytest.mark.parametrize(("rows", "slabs"), [(33, "several"), (100, "several"), (40, "one")])
@pytest.mark.parametrize("gemm", ["blas", "onednn"])
def test_a_batch_past_the_compact_kernels_multiplies_the_stored_weights_in_slabs(
    native: NativeKernels,
    compact_format: str,
    rows: int,
    slabs: str,
    gemm: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A prefill chunk on a model that keeps no float32 copy: the slabs (made small here, so
    that there are several and the last is partial; or the whole weight in one) give the
    float32 product, through torch's BLAS or, as on AMD CPUs with AVX-512
    (CpuCapabilities.float32_gemms_in_onednn), through oneDNN."""
    if gemm == "onednn" and not detect_cpu_capabilities().can_pack("float32"):
        pytest.skip("oneDNN packs no float32 weights here")
    monkeypatch.setattr(native, "onednn_slabs", gemm == "onednn")
    if slabs == "several":
        monkeypatch.setattr("baton.engine.native.slab_products.SLAB_BYTES", 4 * 256 * 20)
        monkeypatch.setattr("baton.engine.native.slab_products.SLAB_MIN_FEATURES", 1)
    width = whole_blocks(160, compact_format)
    weight = np.random.default_rng(rows).normal(size=(71, width)).astype(np.float32)
    compact, values = stored_weight(weight, compact_format)
    x = torch.randn(rows, width)
    bias = torch.randn(71)
    expected = x.double() @ values.double().T + bias.double()
    assert_float32_sums(native.stored_product(x, compact, bias), expected, x, values)


# Up to 8 rows of x share one pass over the weights (16 with AVX-512 where they fit L1, as these
# do, their sums taken together from 12 rows); 13, 17 and 32 take several passes, the last one
# partial for 13 and 17 (of one row with AVX-512); 71 outputs split unevenly between the threads.
@pytest.mark.parametrize("compact_format", sorted(FORMATS))
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 9, 12, 13, 16, 17, 32])
def test_the_kernel_sums_as_a_float32_matmul_does_bias_included(
    native: NativeKernels, compact_format: str, rows: int
) -> None:
    width = whole_blocks(160, compact_format)
    check_against_float64(native, compact_format, rows, out_features=71, in_features=width)


# With AVX-512, two to seven rows of Q4_K and Q6_K take the 16-float sweeps while the rows fit L1
# (wide_sweeps512.c: rows x inputs x 4 bytes <= 40 KB), half a super-block dequantized into
# registers at a time: 768 inputs at 2-7 rows, 2560 at 4 (the limit) and 5 (past it: the 8-float
# sweep); Q5_K has no such sweep (the control).
@pytest.mark.parametrize("compact_format", ["q4_k", "q6_k", "q5_k"])
@pytest.mark.parametrize(
    ("rows", "in_features"), [(2, 768), (3, 768), (5, 768), (7, 768), (4, 2560), (5, 2560)]
)
def test_two_to_seven_rows_of_k_quants_sum_as_a_float32_matmul_does(
    native: NativeKernels, compact_format: str, rows: int, in_features: int
) -> None:
    check_against_float64(native, compact_format, rows, out_features=37, in_features=in_features)


@pytest.mark.parametrize("compact_format", sorted(FORMATS))
@pytest.mark.parametrize("rows", [1, 2, 3])
def test_a_few_rows_sum_by_block_as_a_float32_matmul_does(
    native: NativeKernels, compact_format: str, rows: int
) -> None:
    """One to three rows (decode steps of a few sequences), where block formats' sums are
    factored by block (d * (x . q) + m * sum(x): native/linear/factored_row.c): over several
    super-blocks, with activations of a large common offset, so that the blocks' minima and
    offsets weigh as much as their quants do."""
    width = whole_blocks(1024, compact_format)
    rng = np.random.default_rng(5)
    weight = (rng.normal(size=(37, width)) + 0.5).astype(np.float32)
    compact, values = stored_weight(weight, compact_format)
    x = torch.from_numpy((rng.normal(size=(rows, width)) + 4.0).astype(np.float32))
    bias = torch.from_numpy(rng.normal(size=37).astype(np.float32))
    expected = x.double() @ values.double().T + bias.double()
    assert_float32_sums(native.gemv(x, compact, bias), expected, x, values)


# From 8 rows (STAGED_MIN_ROWS) the staged kernel (staged_gemm.c) takes the product without
# AVX-512: 12 weight rows a stage, 256 inputs a slice, 32 rows of x a pass, 128 a block; with
# AVX-512 whole groups of 16 rows take the group tiles (staged_groups512.c), and a last 14 or
# 15 rows too, as a group padded with zero rows (PADDED_GROUP_MIN_ROWS), the rest the
# k-vectorised ones. Here inputs span several slices, the last one partial for the 32-weight
# blocks (608: 256 + 256 + 96), 9 rows tile as 3 + 3 + 3, rows of x take more than one pass
# without AVX-512 (50, 70) and groups and the rest with it (50: a pair of groups, one more and
# 2 rows; 15: one padded group; 32: two whole ones), and more than one block (150: the second
# one a group and 6 rows; 142: one padded group of 14), and 37 outputs are not whole stages.
@pytest.mark.parametrize("compact_format", sorted(FORMATS))
@pytest.mark.parametrize("rows", [9, 15, 32, 50, 70, 142, 150])
def test_a_batch_over_several_slices_and_passes_sums_as_a_float32_matmul_does(
    native: NativeKernels, compact_format: str, rows: int
) -> None:
    width = whole_blocks(600, compact_format)
    check_against_float64(native, compact_format, rows, out_features=37, in_features=width)


# Weight rows far longer than a layer's here: rows of x no longer fit in L1 (the AVX-512 sweep
# then takes 8 a pass) and the float32 sums are long.
@pytest.mark.parametrize("compact_format", ["bf16", "q4_1"])
@pytest.mark.parametrize("in_features", [5472, 16416])
@pytest.mark.parametrize("rows", [13, 16])
def test_long_weight_rows_in_a_large_batch(
    native: NativeKernels, compact_format: str, in_features: int, rows: int
) -> None:
    check_against_float64(native, compact_format, rows, out_features=20, in_features=in_features)


def test_a_linear_uses_compact_weights_up_to_the_row_limit_only(native: NativeKernels) -> None:
    calls = []

    class CountingKernels:
        def gemv(self, x, weight, bias):
            calls.append(x.shape[0])
            return native.gemv(x, weight, bias)

    linear = Linear(64, 48, True, torch.float32, "cpu")
    stored = torch.randn(48, 64).to(torch.bfloat16)
    linear.weight.data.copy_(stored)
    linear.bias.data.normal_()
    linear.compact, linear.native = CompactWeight.from_tensor(stored), CountingKernels()
    for rows in (1, COMPACT_MAX_ROWS, COMPACT_MAX_ROWS + 1):
        x = torch.randn(rows, 64)
        expected = F.linear(x, stored.float(), linear.bias)
        torch.testing.assert_close(linear(x), expected, rtol=1e-5, atol=1e-5)
    assert calls == [1, COMPACT_MAX_ROWS]


@pytest.mark.parametrize("compact_format", ["q4_k", "q6_k", "f16", "q4_0"])
def test_a_weight_held_only_as_stored_takes_the_staged_tiles_further_with_avx512(
    native: NativeKernels, compact_format: str
) -> None:
    """With no float32 copy, a batch past the compact kernels' rows is float32 slabs; with
    AVX-512 the staged tiles keep batches up to STORED_MAX_ROWS, as a 128-token prompt's
    prefill chunk, where formats with 16-float sweeps keep COMPACT_MAX_ROWS. Every size gives
    the float32 product."""
    calls: list[tuple[str, int]] = []

    class CountingKernels:
        avx512 = native.avx512

        def gemv(self, x, weight, bias):
            calls.append(("compact", x.shape[0]))
            return native.gemv(x, weight, bias)

        def stored_product(self, x, weight, bias):
            calls.append(("slabs", x.shape[0]))
            return native.stored_product(x, weight, bias)

    width = whole_blocks(256, compact_format)
    weight = np.random.default_rng(3).normal(size=(24, width)).astype(np.float32)
    linear = Linear(width, 24, True, torch.float32, "cpu")
    linear.compact, values = stored_weight(weight, compact_format)
    linear.native = CountingKernels()
    linear.bias.data.normal_()
    linear.hold_stored_only()
    further = native.avx512 and compact_format in STAGED_FORMATS
    most = STORED_MAX_ROWS if further else COMPACT_MAX_ROWS
    for rows in (COMPACT_MAX_ROWS + 1, most, most + 1):
        x = torch.randn(rows, width)
        expected = x.double() @ values.double().T + linear.bias.double()
        assert_float32_sums(linear(x), expected, x, values)
    kernels = ["compact", "compact", "slabs"] if further else ["slabs", "compact", "slabs"]
    assert calls == list(zip(kernels, (COMPACT_MAX_ROWS + 1, most, most + 1)))


@pytest.mark.parametrize("variant", ["llama", "qwen2"])
def test_every_linear_of_a_bf16_checkpoint_gets_its_stored_weights(
    tiny_model_factory: Callable[..., Path], native: NativeKernels, variant: str
) -> None:
    """Fused q/k/v and gate/up are assembled from their parts; a tied head reads the
    embedding's stored bytes."""
    checkpoint = load_checkpoint(str(tiny_model_factory(variant, weights_dtype=torch.bfloat16)))
    model = CausalLM(checkpoint.config, torch.float32, "cpu")
    model.load_weights(iter_weights(checkpoint))
    attached = model.attach_compact_weights(iter_compact_weights(checkpoint), native)
    linears = [module for module in model.modules() if isinstance(module, Linear)]
    assert len(linears) == 4 * checkpoint.config.num_layers + 1
    assert len(attached) == 7 * checkpoint.config.num_layers + 1  # q, k, v, o, gate, up, down
    for linear in linears:
        assert torch.equal(linear.compact.data.view(torch.bfloat16).float(), linear.weight)


def test_a_fused_layer_whose_parts_differ_in_format_multiplies_each_part_as_stored(
    tiny_model_factory: Callable[..., Path], native: NativeKernels
) -> None:
    """A GGUF's q and k in Q4_K with v in Q6_K: the fused weight holds its parts, each
    multiplied in its own format into its columns (with its share of the bias)."""
    checkpoint = load_checkpoint(str(tiny_model_factory("qwen2", weights_dtype=torch.bfloat16)))
    model = CausalLM(checkpoint.config, torch.float32, "cpu")
    model.load_weights(iter_weights(checkpoint))
    odd_one = "model.layers.0.self_attn.k_proj.weight"

    def weights():
        for name, compact in iter_compact_weights(checkpoint):
            if name == odd_one:
                stored = compact.data.view(torch.bfloat16).to(torch.float16)
                compact = CompactWeight.from_tensor(stored)
            yield name, compact

    attached = model.attach_compact_weights(weights(), native)
    assert len(attached) == 7 * checkpoint.config.num_layers + 1  # and the tied head
    qkv = model.layers[0].self_attn.qkv_proj
    assert qkv.compact.format == PARTS
    assert [part.format for part in qkv.compact.parts] == ["bf16", "f16", "bf16"]
    assert model.layers[1].self_attn.qkv_proj.compact.format == "bf16"
    # The float32 weights hold the same values (bf16 -> f16 is exact for these small weights).
    x = torch.randn(5, qkv.in_features)
    expected = x.double() @ qkv.weight.double().T + qkv.bias.double()
    for rows in (1, 3, 5):
        got = native.gemv(x[:rows], qkv.compact, qkv.bias)
        torch.testing.assert_close(got.double(), expected[:rows], rtol=1e-5, atol=1e-5)
    for onednn in (False, True):
        native.onednn_slabs = onednn and detect_cpu_capabilities().can_pack("float32")
        got = native.stored_product(x, qkv.compact, qkv.bias)
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


def random_blocks_of(values: np.ndarray, quant: gguf.GGMLQuantizationType) -> np.ndarray:
    """A matrix's blocks for a type gguf cannot quantize: random ones (helpers'
    random_blocks), scaled so that a tiny model's activations stay of the usual size."""
    rows, width = values.shape
    return random_blocks(quant.name.lower(), rows, width, seed=values.size, scale=0.0005)


# The k-quants and IQ4 need in_features in whole 256-weight super-blocks: a wider tiny model.
WIDE_TINY = {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64}


@pytest.mark.parametrize(
    "tensor_type",
    ["Q4_0", "Q4_1", "Q8_0", "BF16", "Q5_0", "Q5_1", "IQ4_NL"]
    + [name.upper() for name in SCALE_OFFSETS if FORMATS[name].block == 256],
)
@pytest.mark.parametrize("variant", ["llama", "qwen3"])
def test_greedy_tokens_from_a_quantized_gguf_equal_transformers_on_its_weights(
    tiny_model_factory: Callable[..., Path],
    tmp_path: Path,
    native: NativeKernels,
    variant: str,
    tensor_type: str,
) -> None:
    """transformers gets the GGUF's weights dequantized to float32; Baton multiplies the stored
    blocks in decode batches and the dequantized weights in prefill: same tokens. (transformers
    cannot load these GGUFs itself: it ignores a llama head_dim other than hidden / heads.)"""
    from transformers import AutoModelForCausalLM

    plain_rope = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    random = tensor_type.lower() in SCALE_OFFSETS
    wide = WIDE_TINY if FORMATS[tensor_type.lower()].block == 256 else {}
    model_dir = tiny_model_factory(variant, vocab_size=300, **plain_rope, **wide)
    target = tmp_path / f"tiny-{tensor_type}.gguf"
    path = export_gguf(
        model_dir, "float32", target, tensor_type, random_blocks_of if random else None
    )
    llm = LLM(str(path))
    model = llm.engine.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    # Held as stored: no float32 copy of any matrix or of the embedding.
    assert all(linear.compact is not None and linear.stored_only for linear in linears)
    assert model.embedding_stored is not None and model.embed_tokens.numel() == 0
    assert all(linear.weight.numel() == 0 for linear in linears)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    checkpoint = load_checkpoint(str(path))
    dequantized = dict(iter_weights(checkpoint))
    # The engine loads through the native kernels: the same bits, llama's q/k rows included.
    loaded = dict(iter_weights(checkpoint, native))
    assert all(torch.equal(loaded[name], tensor) for name, tensor in dequantized.items())
    assert not reference.load_state_dict(dequantized, strict=False).unexpected_keys
    if llm.engine.decode_step.native.avx512 and tensor_type.lower() in BLOCK_FORMATS:
        blocks = [linear for linear in linears if linear.compact.format in BLOCK_FORMATS]
        assert blocks and all(linear.compact.panels is not None for linear in blocks)
    # Five rows a decode step: AVX-512 CPUs multiply block layers' panels (from 3 rows). The
    # 40-token prompt is past the compact kernels' 32 rows: its prefill multiplies the blocks a
    # float32 slab at a time.
    prompts = [[1, 2, 3, 4, 5], [40, 41, 42], [7] * 40, [9, 8, 7], [100, 200, 50, 25]]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    for prompt, output in zip(prompts, outputs):
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + output.token_ids])).logits[0]
        # Teacher-forced: each of Baton's tokens is transformers' argmax after the same prefix.
        assert logits[len(prompt) - 1 : -1].argmax(-1).tolist() == output.token_ids


def test_a_bf16_checkpoint_computed_in_float32_matches_transformers(
    tiny_model_factory: Callable[..., Path],
) -> None:
    model_dir = tiny_model_factory("llama", weights_dtype=torch.bfloat16)
    llm = LLM(str(model_dir), dtype="float32")
    assert llm.engine.plan.compact_small_batches
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    [output] = llm.generate([prompt], params)
    assert output.token_ids == hf_greedy_generate(model_dir, prompt, 20)


def test_without_a_compiler_the_engine_says_so_and_computes_with_torch_alone(
    tiny_model_factory: Callable[..., Path],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # nothing built here yet
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    with pytest.raises(NativeBuildError, match="cannot write under"):
        load_native_kernels(blocker / "native")  # an unwritable cache
    monkeypatch.setenv("CC", "no-such-compiler")
    with pytest.raises(NativeBuildError, match="no C compiler"):
        load_native_kernels()
    monkeypatch.setenv("CC", "false")  # a compiler that fails
    with pytest.raises(NativeBuildError, match="false failed on the native kernels"):
        load_native_kernels()
    model_dir = tiny_model_factory("llama", weights_dtype=torch.bfloat16)
    with caplog.at_level(logging.WARNING):
        llm = LLM(str(model_dir), dtype="float32")
    assert "no native kernels here" in caplog.text
    assert llm.engine.model.lm_head.compact is None
    assert llm.engine.attention.native is None
    assert llm.engine.model.layers[0].self_attn.native is None
    assert llm.engine.model.layers[0].input_layernorm.native is None
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    [output] = llm.generate([prompt], params)
    assert output.token_ids == hf_greedy_generate(model_dir, prompt, 8)


def test_the_engine_widens_its_vectors_only_where_its_isa_allows(
    tiny_model_factory: Callable[..., Path],
) -> None:
    """AVX-512's compact kernel only where the plan's ISA (after --max-cpu-isa and torch's and
    oneDNN's caps) has AVX-512."""
    path = tiny_model_factory("qwen2", weights_dtype=torch.bfloat16)
    capped = LLM(str(path), max_cpu_isa="avx2")
    assert capped.engine.decode_step is not None and not capped.engine.decode_step.native.avx512
    engine = LLM(str(path)).engine
    assert engine.decode_step.native.avx512 == (isa_rank(engine.cpu.isa) >= isa_rank("avx512"))
