"""GGUF blocks multiplied in AMX tiles, on CPUs with AMX only, from 5-9 rows
(native/linear/amx_blocks.c): float32 precision, which batches take the tiles, and a served GGUF's
tokens. (bf16 weights' tiles: test_bf16_tiles.py.)"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import pytest
import torch
from helpers.decode_steps import CountingStep

from baton import LLM, SamplingParams
from baton.bench.gguf_export import export_gguf
from baton.checkpoint.load import load_checkpoint
from baton.engine.cpu.capabilities import detect_cpu_capabilities
from baton.engine.models.layers import Linear
from baton.engine.native.formats import BLOCK_FORMATS, CompactWeight
from baton.engine.native.library import NativeKernels
from baton.engine.weights.checkpoint_tensors import iter_weights


@pytest.fixture(scope="module")
def amx(native: NativeKernels) -> NativeKernels:
    if not native.amx:
        pytest.skip("needs a CPU with AMX-BF16 (and a kernel that lends its tiles)")
    return native


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
