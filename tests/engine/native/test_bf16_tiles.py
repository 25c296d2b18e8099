"""bf16 weights in tile order, every batch of 2 rows or more, decode steps and prefill chunks, on
each bf16 unit this CPU has: AMX's tiles (native/linear/amx_gemm.c) and AVX512_BF16's dot
products (native/linear/bf16_dot_gemm.c, which AMD's Zen 4 and Zen 5 run, and AMX CPUs too): the
product against a float64 reference of the same bf16 operands, the rows' rounding against
torch's, a row's result whatever its batch, the gated MLP's activation from the tiles against the
unfused one, and a served model's tokens against its op-by-op path and transformers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import assert_greedy_matches_hf
from helpers.decode_steps import CountingStep

import baton.engine.engine as engine_module
from baton import LLM, SamplingParams
from baton.engine.cpu.capabilities import detect_cpu_capabilities
from baton.engine.decode_step import NATIVE_STEP_MAX_ROWS
from baton.engine.models.layers import Linear
from baton.engine.native.formats import CompactWeight
from baton.engine.native.library import NativeKernels, load_native_kernels

# Rows rounded to bf16 move these models' logits by up to ~0.2 each (test_llm's tolerance).
BF16_TIE_TOLERANCE = 0.5
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module", params=["amx", "avx512_bf16"])
def tiles(request: pytest.FixtureRequest) -> NativeKernels:
    """The kernels with bf16 tiles multiplied by one unit: AMX, or AVX512_BF16's dot products
    (AMX kept out, so an AMX CPU runs both)."""
    kernels = load_native_kernels(amx=request.param == "amx")
    if request.param == "amx" and not kernels.amx:
        pytest.skip("needs a CPU with AMX-BF16 (and a kernel that lends its tiles)")
    if request.param == "avx512_bf16" and not kernels.bf16_dot:
        pytest.skip("needs a CPU with AVX512_BF16")
    return kernels


def _tiled(tiles: NativeKernels, weight: torch.Tensor) -> CompactWeight:
    compact = CompactWeight.from_tensor(weight.to(torch.bfloat16))
    assert compact is not None
    return tiles.with_tiles(compact)


# (out_features, in_features): one pair of tiles; n padded; the 0.5B shape's widest layers.
# Rows: one or two tiles of 16, then several blocks of 32 and a partial one; 700 rows of 896
# inputs fill more than one group of rows (amx_gemm.c's GROUP_BYTES), as 300 rows of 4864 do.
@pytest.mark.parametrize(("n", "k"), [(32, 32), (40, 96), (1152, 896), (896, 4864)])
@pytest.mark.parametrize("rows", [2, 3, 16, 17, 32, 33, 300, 700])
def test_tiles_multiply_the_rows_rounded_to_bf16(
    tiles: NativeKernels, n: int, k: int, rows: int
) -> None:
    generator = torch.Generator().manual_seed(rows * n + k)
    weight = torch.randn(n, k, generator=generator).to(torch.bfloat16)
    x, bias = torch.randn(rows, k, generator=generator), torch.randn(n, generator=generator)
    tiled = _tiled(tiles, weight)
    want = x.to(torch.bfloat16).double() @ weight.double().T
    # Exact products, float32 sums of k terms: far inside this bound.
    for got, expected in (
        (tiles.gemv(x, tiled, bias), want + bias.double()),
        (tiles.gemv(x, tiled, None), want),
    ):
        torch.testing.assert_close(got.double(), expected, rtol=0, atol=1e-5 * k**0.5)


def test_a_rows_product_does_not_depend_on_its_batch(tiles: NativeKernels) -> None:
    """Each row sums its products in one order, whichever block, group and thread it falls in:
    a prefill's rows are those of any other batch, bit for bit."""
    generator = torch.Generator().manual_seed(4)
    tiled = _tiled(tiles, torch.randn(200, 896, generator=generator))
    x, bias = torch.randn(700, 896, generator=generator), torch.randn(200, generator=generator)
    whole = tiles.gemv(x, tiled, bias)
    for first, rows in ((0, 2), (17, 15), (590, 33), (650, 50)):
        assert torch.equal(
            tiles.gemv(x[first : first + rows], tiled, bias), whole[first : first + rows]
        )


def test_bf16_rows_multiply_as_they_are(tiles: NativeKernels) -> None:
    """Rows already in bf16 (the MLP's activation) give the product of their float32 values."""
    generator = torch.Generator().manual_seed(5)
    tiled = _tiled(tiles, torch.randn(48, 64, generator=generator))
    x = torch.randn(40, 64, generator=generator).to(torch.bfloat16)
    assert torch.equal(tiles.gemv(x, tiled, None), tiles.gemv(x.float(), tiled, None))
    with pytest.raises(ValueError, match="rows of 32 inputs"):
        tiles.gemv(x[:, :32], tiled, None)


@pytest.mark.parametrize(("n", "k"), [(40, 96), (896, 4864)])
@pytest.mark.parametrize("rows", [2, 17, 300])
def test_products_joining_the_residual_stream_start_from_it(
    tiles: NativeKernels, n: int, k: int, rows: int
) -> None:
    """The o and down projections add into the residual rows in place: their sums start from
    them (whole tiles and a last partial one), from float32 or bf16 rows alike; with a bias, or
    one row (the compact kernel), the product comes first, then the sum."""
    generator = torch.Generator().manual_seed(rows + n + k)
    weight = torch.randn(n, k, generator=generator).to(torch.bfloat16)
    x, bias = torch.randn(rows, k, generator=generator), torch.randn(n, generator=generator)
    residual = torch.randn(rows, n, generator=generator)
    tiled = _tiled(tiles, weight)
    got = tiles.gemv_add(x, tiled, None, residual.clone())
    want = residual.double() + x.to(torch.bfloat16).double() @ weight.double().T
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5 * k**0.5)
    assert torch.equal(tiles.gemv_add(x.to(torch.bfloat16), tiled, None, residual.clone()), got)
    with_bias = tiles.gemv_add(x, tiled, bias, residual.clone())
    assert torch.equal(with_bias, tiles.gemv(x, tiled, bias) + residual)
    one_row = tiles.gemv_add(x[:1], tiled, None, residual[:1].clone())
    assert torch.equal(one_row, tiles.gemv(x[:1], tiled, None) + residual[:1])


@pytest.mark.parametrize(("inter", "k"), [(16, 32), (48, 96), (4864, 896)])
@pytest.mark.parametrize("rows", [2, 17, 33, 300])
def test_the_gated_activation_from_the_tiles_is_the_unfused_one(
    tiles: NativeKernels, inter: int, k: int, rows: int
) -> None:
    """silu(gate) * up from the tile registers, rounded to bf16, equals the [gate | up] product
    written out, then the native activation, then the rounding (bias or none), bit for bit."""
    generator = torch.Generator().manual_seed(rows + inter + k)
    tiled = _tiled(tiles, torch.randn(2 * inter, k, generator=generator))
    x, bias = torch.randn(rows, k, generator=generator), torch.randn(2 * inter, generator=generator)
    for b in (bias, None):
        fused = tiles.tiles_product(x, tiled, b, gated=True)
        unfused = tiles.silu_mul(tiles.gemv(x, tiled, b)).to(torch.bfloat16)
        assert fused.dtype == torch.bfloat16 and torch.equal(fused, unfused)


def test_one_row_reads_the_compact_weights_in_float32(tiles: NativeKernels) -> None:
    """One row keeps the exact float32 products of the compact kernel (transformers' float32
    arithmetic): the tiles serve two rows or more."""
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(64, 96, generator=generator).to(torch.bfloat16)
    x = torch.randn(1, 96, generator=generator)
    compact = CompactWeight.from_tensor(weight)
    assert torch.equal(tiles.gemv(x, _tiled(tiles, weight), None), tiles.gemv(x, compact, None))


def test_rows_round_to_bf16_as_torch_rounds_them(tiles: NativeKernels) -> None:
    """Through an identity weight each output is its input rounded to bf16: halfway cases go to
    the even neighbour, as torch's conversion does (AMX itself flushes subnormals, so none)."""
    k = 64
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(2)) * 1000
    bits = x.view(torch.int32)
    bits[0, :16] = (bits[0, :16] & ~0xFFFF) | 0x8000  # exactly halfway, odd and even
    bits[1, :16] = (bits[1, :16] & ~0xFFFF) | 0x7FFF  # just below halfway
    got = tiles.gemv(x, _tiled(tiles, torch.eye(k)), None)
    assert torch.equal(got, x.to(torch.bfloat16).float())


@pytest.mark.parametrize("variant", ["llama", "qwen2", "qwen3"])
def test_served_batches_keep_the_op_by_op_tokens_and_transformers_ones(
    tiles: NativeKernels,
    tiny_model_factory: Callable[..., Path],
    monkeypatch: pytest.MonkeyPatch,
    variant: str,
) -> None:
    """This machine's own plan on a bf16 checkpoint, where its ISA is the unit's: every layer
    holds tiles, which take every batch but one row's (the compact weights'); decode batches of
    1 to 32 rows run natively, with the tokens of the same plan op by op, and up to bf16's
    near-ties those of transformers; a chunked prefill's MLPs take their activation from the
    tiles."""
    isa = detect_cpu_capabilities().isa
    on_amx = tiles.amx
    if isa != ("amx" if on_amx else "avx512_bf16"):
        pytest.skip(f"this CPU's plan ({isa}) multiplies bf16 tiles with another unit")

    def no_crossover_timing(run_step, model, largest: int) -> int:
        raise AssertionError("the tiles take every batch: start-up has nothing to time")

    monkeypatch.setattr(engine_module, "compact_crossover", no_crossover_timing)
    path = tiny_model_factory(variant, weights_dtype=torch.bfloat16)
    native, eager = LLM(str(path), chunk_size=40), LLM(str(path), enforce_eager=True, chunk_size=40)
    plan = native.engine.plan
    assert (plan.amx_tiles, plan.bf16_dot_tiles) == (on_amx, not on_amx)
    assert native.engine.decode_step.native.amx == on_amx
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
