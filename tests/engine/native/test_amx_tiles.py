"""Batches multiplied in AMX tiles, on CPUs with AMX only. bf16 weights, every batch of 2 rows or
more, decode steps and prefill chunks (native/linear/amx_gemm.c): the product against a float64
reference of the same bf16 operands, the rows' rounding against torch's, a row's result whatever
its batch, the gated MLP's activation from the tiles against the unfused one, and a served
model's tokens against its op-by-op path and transformers. GGUF blocks from 5-9 rows
(native/linear/amx_blocks.c): float32 precision, which batches take the tiles, and a served GGUF's
tokens."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import pytest
import torch
from helpers import assert_greedy_matches_hf
from helpers.decode_steps import CountingStep

import baton.engine.engine as engine_module
from baton import LLM, SamplingParams
from baton.bench.gguf_export import export_gguf
from baton.checkpoint.load import load_checkpoint
from baton.engine.cpu.capabilities import detect_cpu_capabilities
from baton.engine.decode_step import NATIVE_STEP_MAX_ROWS
from baton.engine.models.layers import Linear
from baton.engine.native.formats import BLOCK_FORMATS, CompactWeight
from baton.engine.native.library import NativeKernels
from baton.engine.weights.checkpoint_tensors import iter_weights

# Rows rounded to bf16 move these models' logits by up to ~0.2 each (test_llm's tolerance).
BF16_TIE_TOLERANCE = 0.5
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def amx(native: NativeKernels) -> NativeKernels:
    if not native.amx:
        pytest.skip("needs a CPU with AMX-BF16 (and a kernel that lends its tiles)")
    return native


def _tiled(amx: NativeKernels, weight: torch.Tensor) -> CompactWeight:
    compact = CompactWeight.from_tensor(weight.to(torch.bfloat16))
    assert compact is not None
    return amx.with_tiles(compact)


# (out_features, in_features): one pair of tiles; n padded; the 0.5B shape's widest layers.
# Rows: one or two tiles of 16, then several blocks of 32 and a partial one; 700 rows of 896
# inputs fill more than one group of rows (amx_gemm.c's GROUP_BYTES), as 300 rows of 4864 do.
@pytest.mark.parametrize(("n", "k"), [(32, 32), (40, 96), (1152, 896), (896, 4864)])
@pytest.mark.parametrize("rows", [2, 3, 16, 17, 32, 33, 300, 700])
def test_tiles_multiply_the_rows_rounded_to_bf16(
    amx: NativeKernels, n: int, k: int, rows: int
) -> None:
    generator = torch.Generator().manual_seed(rows * n + k)
    weight = torch.randn(n, k, generator=generator).to(torch.bfloat16)
    x, bias = torch.randn(rows, k, generator=generator), torch.randn(n, generator=generator)
    tiled = _tiled(amx, weight)
    want = x.to(torch.bfloat16).double() @ weight.double().T
    # Exact products, float32 sums of k terms: far inside this bound.
    for got, expected in (
        (amx.gemv(x, tiled, bias), want + bias.double()),
        (amx.gemv(x, tiled, None), want),
    ):
        torch.testing.assert_close(got.double(), expected, rtol=0, atol=1e-5 * k**0.5)


def test_a_rows_product_does_not_depend_on_its_batch(amx: NativeKernels) -> None:
    """Each row sums its products in one order, whichever block, group and thread it falls in:
    a prefill's rows are those of any other batch, bit for bit."""
    generator = torch.Generator().manual_seed(4)
    tiled = _tiled(amx, torch.randn(200, 896, generator=generator))
    x, bias = torch.randn(700, 896, generator=generator), torch.randn(200, generator=generator)
    whole = amx.gemv(x, tiled, bias)
    for first, rows in ((0, 2), (17, 15), (590, 33), (650, 50)):
        assert torch.equal(
            amx.gemv(x[first : first + rows], tiled, bias), whole[first : first + rows]
        )


def test_bf16_rows_multiply_as_they_are(amx: NativeKernels) -> None:
    """Rows already in bf16 (the MLP's activation) give the product of their float32 values."""
    generator = torch.Generator().manual_seed(5)
    tiled = _tiled(amx, torch.randn(48, 64, generator=generator))
    x = torch.randn(40, 64, generator=generator).to(torch.bfloat16)
    assert torch.equal(amx.gemv(x, tiled, None), amx.gemv(x.float(), tiled, None))
    with pytest.raises(ValueError, match="rows of 32 inputs"):
        amx.gemv(x[:, :32], tiled, None)


@pytest.mark.parametrize(("n", "k"), [(40, 96), (896, 4864)])
@pytest.mark.parametrize("rows", [2, 17, 300])
def test_products_joining_the_residual_stream_start_from_it(
    amx: NativeKernels, n: int, k: int, rows: int
) -> None:
    """The o and down projections add into the residual rows in place: their sums start from
    them (whole tiles and a last partial one), from float32 or bf16 rows alike; with a bias, or
    one row (the compact kernel), the product comes first, then the sum."""
    generator = torch.Generator().manual_seed(rows + n + k)
    weight = torch.randn(n, k, generator=generator).to(torch.bfloat16)
    x, bias = torch.randn(rows, k, generator=generator), torch.randn(n, generator=generator)
    residual = torch.randn(rows, n, generator=generator)
    tiled = _tiled(amx, weight)
    got = amx.gemv_add(x, tiled, None, residual.clone())
    want = residual.double() + x.to(torch.bfloat16).double() @ weight.double().T
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5 * k**0.5)
    assert torch.equal(amx.gemv_add(x.to(torch.bfloat16), tiled, None, residual.clone()), got)
    with_bias = amx.gemv_add(x, tiled, bias, residual.clone())
    assert torch.equal(with_bias, amx.gemv(x, tiled, bias) + residual)
    one_row = amx.gemv_add(x[:1], tiled, None, residual[:1].clone())
    assert torch.equal(one_row, amx.gemv(x[:1], tiled, None) + residual[:1])


@pytest.mark.parametrize(("inter", "k"), [(16, 32), (48, 96), (4864, 896)])
@pytest.mark.parametrize("rows", [2, 17, 33, 300])
def test_the_gated_activation_from_the_tiles_is_the_unfused_one(
    amx: NativeKernels, inter: int, k: int, rows: int
) -> None:
    """silu(gate) * up from the tile registers, rounded to bf16, equals the [gate | up] product
    written out, then the native activation, then the rounding (bias or none), bit for bit."""
    generator = torch.Generator().manual_seed(rows + inter + k)
    tiled = _tiled(amx, torch.randn(2 * inter, k, generator=generator))
    x, bias = torch.randn(rows, k, generator=generator), torch.randn(2 * inter, generator=generator)
    for b in (bias, None):
        fused = amx.tiles_product(x, tiled, b, gated=True)
        unfused = amx.silu_mul(amx.gemv(x, tiled, b)).to(torch.bfloat16)
        assert fused.dtype == torch.bfloat16 and torch.equal(fused, unfused)


def test_one_row_reads_the_compact_weights_in_float32(amx: NativeKernels) -> None:
    """One row keeps the exact float32 products of the compact kernel (transformers' float32
    arithmetic): the tiles serve two rows or more."""
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(64, 96, generator=generator).to(torch.bfloat16)
    x = torch.randn(1, 96, generator=generator)
    compact = CompactWeight.from_tensor(weight)
    assert torch.equal(amx.gemv(x, _tiled(amx, weight), None), amx.gemv(x, compact, None))


def test_rows_round_to_bf16_as_torch_rounds_them(amx: NativeKernels) -> None:
    """Through an identity weight each output is its input rounded to bf16: halfway cases go to
    the even neighbour, as torch's conversion does (AMX itself flushes subnormals, so none)."""
    k = 64
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(2)) * 1000
    bits = x.view(torch.int32)
    bits[0, :16] = (bits[0, :16] & ~0xFFFF) | 0x8000  # exactly halfway, odd and even
    bits[1, :16] = (bits[1, :16] & ~0xFFFF) | 0x7FFF  # just below halfway
    got = amx.gemv(x, _tiled(amx, torch.eye(k)), None)
    assert torch.equal(got, x.to(torch.bfloat16).float())


@pytest.mark.parametrize("variant", ["llama", "qwen2", "qwen3"])
def test_served_batches_keep_the_op_by_op_tokens_and_transformers_ones(
    amx: NativeKernels,
    tiny_model_factory: Callable[..., Path],
    monkeypatch: pytest.MonkeyPatch,
    variant: str,
) -> None:
    """This machine's own plan on a bf16 checkpoint: every layer holds tiles, which take every
    batch but one row's (the compact weights'); decode batches of 1 to 32 rows run natively, with
    the tokens of the same plan op by op, and up to bf16's near-ties those of transformers; a
    chunked prefill's MLPs take their activation from the tiles."""
    if detect_cpu_capabilities().isa != "amx":
        pytest.skip("the plan is capped below AMX here (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA)")

    def no_crossover_timing(run_step, model, largest: int) -> int:
        raise AssertionError("the tiles take every batch: start-up has nothing to time")

    monkeypatch.setattr(engine_module, "compact_crossover", no_crossover_timing)
    path = tiny_model_factory(variant, weights_dtype=torch.bfloat16)
    native, eager = LLM(str(path), chunk_size=40), LLM(str(path), enforce_eager=True, chunk_size=40)
    assert native.engine.plan.amx_tiles
    linears = [m for m in native.engine.model.modules() if isinstance(m, Linear)]
    assert all(linear.compact.tiles is not None for linear in linears)
    # No batch reaches their GEMMs: their bf16 weights (and the head's float32 one, unless
    # tied) are freed, and nothing is packed for oneDNN.
    assert all(linear.weight.numel() == 0 and not linear.packed for linear in linears)
    gated_calls = []
    product = NativeKernels.tiles_product

    def counting_product(self, x, weight, bias, gated=False, into=None):
        gated_calls.append(gated)
        return product(self, x, weight, bias, gated, into)

    monkeypatch.setattr(NativeKernels, "tiles_product", counting_product)
    counting = native.engine.decode_step = CountingStep(native.engine.decode_step)
    for batch in (1, 2, 17, NATIVE_STEP_MAX_ROWS):
        prompts = [[(7 * i + j) % 250 for j in range(3 + i % 5)] for i in range(batch)]
        before = counting.batches
        outputs = native.generate(prompts, GREEDY)
        got = [output.token_ids for output in outputs]
        assert got == [output.token_ids for output in eager.generate(prompts, GREEDY)], batch
        assert counting.batches - before == GREEDY.max_tokens - 1
        for prompt, tokens in zip(prompts[:3], got, strict=False):
            assert_greedy_matches_hf(path, prompt, tokens, BF16_TIE_TOLERANCE)
    # A prompt of several chunks: each chunk's MLPs take their activation from the tiles.
    long = [(11 * j) % 250 for j in range(90)]
    gated_calls.clear()
    [output] = native.generate([long], GREEDY)
    assert sum(gated_calls) == 3 * len(native.engine.model.layers)
    assert output.token_ids == eager.generate([long], GREEDY)[0].token_ids
    assert_greedy_matches_hf(path, long, output.token_ids, BF16_TIE_TOLERANCE)


def _blocks(weight: torch.Tensor, block_format: str) -> tuple[CompactWeight, torch.Tensor]:
    """`weight` in a GGUF block format, and the float32 values its blocks stand for."""
    quant = getattr(gguf.GGMLQuantizationType, block_format.upper())
    blocks = gguf.quants.quantize(weight.numpy(), quant)
    values = gguf.quants.dequantize(blocks, quant).reshape(weight.shape)
    return CompactWeight(block_format, torch.from_numpy(blocks), weight.shape[1]), torch.from_numpy(
        values
    )


# (out_features, in_features): one tile, padded features, SmolLM2's down projection.
@pytest.mark.parametrize(("n", "k"), [(32, 32), (40, 96), (576, 1536)])
# Rows: one group of 16 and two (each block widened just before its products), then several
# pairs of groups (a matrix's blocks widened once).
@pytest.mark.parametrize("rows", [9, 30, 33, 300])
@pytest.mark.parametrize("block_format", BLOCK_FORMATS)
def test_block_tiles_multiply_in_float32_precision(
    amx: NativeKernels, n: int, k: int, rows: int, block_format: str
) -> None:
    """The blocks' integers in tiles, their sums scaled per block, keep float32's precision: the
    error against a float64 product of the dequantized weights is that of float32 sums, far
    under what rows rounded to bf16 (as plain bf16 tiles compute) would give."""
    generator = torch.Generator().manual_seed(rows * n + k)
    compact, values = _blocks(torch.randn(n, k, generator=generator), block_format)
    x, bias = torch.randn(rows, k, generator=generator), torch.randn(n, generator=generator)
    got = amx.gemv(x, amx.with_tiles(compact), bias).double()
    want = x.double() @ values.double().T + bias.double()
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5 * k**0.5)
    bf16_rows = x.to(torch.bfloat16).double() @ values.double().T + bias.double()
    assert (got - want).abs().max() < (bf16_rows - want).abs().max() / 20


# The rows from which block tiles pay (linear.c's amx_blocks_min_rows): Q8_0's compact
# kernel reads twice Q4's bytes a weight.
TILE_MIN_ROWS = {"q8_0": 5, "q4_0": 9, "q4_1": 9}


@pytest.mark.parametrize("block_format", BLOCK_FORMATS)
def test_block_tiles_take_batches_from_where_they_pay(
    amx: NativeKernels, block_format: str
) -> None:
    """Fewer rows read the blocks (fewer bytes); from TILE_MIN_ROWS the tiles alone are read:
    with the blocks zeroed after tiling, only the smaller batch loses its product."""
    generator = torch.Generator().manual_seed(3)
    compact, values = _blocks(torch.randn(64, 96, generator=generator), block_format)
    tiled = amx.with_tiles(compact)
    compact.data.zero_()
    least = TILE_MIN_ROWS[block_format]
    for rows, reads_tiles in [(least - 1, False), (least, True), (64, True)]:
        x = torch.randn(rows, 96, generator=generator)
        got = amx.gemv(x, tiled, None)
        assert bool(got.abs().max() > 0) == reads_tiles, rows
        if reads_tiles:
            torch.testing.assert_close(got, x @ values.T, rtol=1e-5, atol=1e-4)


def test_a_served_gguf_keeps_transformers_tokens_in_block_tiles(
    amx: NativeKernels, tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """This machine's plan on a Q4_1 GGUF: every linear layer holds block tiles, which its
    prefill and its decode batches of 9 rows or more multiply; 32 prompts at once give the
    tokens of the op-by-op path, and teacher-forced, transformers' float32 argmax."""
    if detect_cpu_capabilities().isa != "amx":
        pytest.skip("the plan is capped below AMX here (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA)")
    from transformers import AutoModelForCausalLM

    plain_rope = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    model_dir = tiny_model_factory("llama", vocab_size=300, **plain_rope)
    path = export_gguf(model_dir, "float32", tmp_path / "tiny-q4_1.gguf", "Q4_1")
    native, eager = LLM(str(path)), LLM(str(path), enforce_eager=True)
    assert native.engine.plan.amx_tiles
    linears = [m for m in native.engine.model.modules() if isinstance(m, Linear)]
    assert all(linear.compact.multiplies_any_rows for linear in linears)
    # No batch reaches their GEMMs: the float32 weights are freed (the tied head's embedding
    # stays the model's) and nothing is packed for oneDNN.
    assert all(linear.weight.numel() == 0 for linear in linears)
    assert native.engine.model.embed_tokens.numel() > 0
    counting = native.engine.decode_step = CountingStep(native.engine.decode_step)
    prompts = [[(11 * i + j) % 290 + 1 for j in range(4 + i % 7)] for i in range(32)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got = [output.token_ids for output in native.generate(prompts, params)]
    assert got == [output.token_ids for output in eager.generate(prompts, params)]
    assert counting.batches == params.max_tokens - 1
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    reference.load_state_dict(dict(iter_weights(load_checkpoint(str(path)))), strict=False)
    for prompt, tokens in zip(prompts[:6], got, strict=False):
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + tokens])).logits[0]
        assert logits[len(prompt) - 1 : -1].argmax(-1).tolist() == tokens


def test_a_block_matrix_that_is_not_whole_blocks_gets_no_tiles(amx: NativeKernels) -> None:
    with pytest.raises(ValueError, match="not whole blocks"):
        amx.with_tiles(CompactWeight("q4_1", torch.zeros(4, 30, dtype=torch.uint8), 48))
