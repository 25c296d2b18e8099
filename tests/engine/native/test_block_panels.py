"""Block weights (Q8_0, Q4_0, Q4_1) in panels of 16 features (native/linear/block_panels.c): the
AVX-512 kernel that multiplies batches of PANEL_MIN_ROWS rows or more."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from helpers.compact_reference import check_against_float64, stored_weight

from baton.engine.cpu.capabilities import detect_cpu_capabilities
from baton.engine.models.layers import Linear
from baton.engine.native.formats import (
    BLOCK_FORMATS,
    COMPACT_MAX_ROWS,
    PANELS_MAX_ROWS,
    CompactWeight,
)
from baton.engine.native.library import NativeKernels, load_native_kernels
from baton.hardware import isa_rank

# linear.c's PANEL_MIN_ROWS: fewer rows read the stored rows.
PANEL_MIN_ROWS = 3

pytestmark = pytest.mark.skipif(
    isa_rank(detect_cpu_capabilities().isa) < isa_rank("avx512") or shutil.which("cc") is None,
    reason="the panels are multiplied with AVX-512, built by a C compiler",
)


@pytest.fixture(scope="module")
def native() -> NativeKernels:
    """The kernels with AVX-512 (conftest's keep 8 floats a vector, which has no panels)."""
    return load_native_kernels(avx512=True)


def _stored(
    rng: np.random.Generator, compact_format: str, out_features: int, in_features: int
) -> tuple[CompactWeight, torch.Tensor]:
    """A random weight in `compact_format`, and the float32 values gguf dequantizes it to."""
    weight = rng.normal(size=(out_features, in_features)).astype(np.float32)
    return stored_weight(weight, compact_format)


# 8 features: one partial group; 40 and 71: the last group of 16 is partial, and 71's groups do
# not pair up evenly.
@pytest.mark.parametrize("compact_format", BLOCK_FORMATS)
@pytest.mark.parametrize("out_features", [8, 40, 71])
def test_the_panels_hold_each_weight_as_exactly_its_float32_value(
    native: NativeKernels, compact_format: str, out_features: int
) -> None:
    compact, values = _stored(np.random.default_rng(0), compact_format, out_features, 96)
    panelled = native.with_panels(compact)
    # One-hot rows pick single weights: no sum, so any difference is in the dequantization.
    assert torch.equal(native.gemv(torch.eye(96), panelled, None), values.T)


# Tiles of up to 12 rows, split evenly (13: 6 + 7; 25: 8 + 8 + 9).
@pytest.mark.parametrize("compact_format", BLOCK_FORMATS)
@pytest.mark.parametrize("rows", [3, 5, 8, 12, 13, 16, 17, 25, 32])
def test_the_panels_sum_as_a_float32_matmul_does_bias_included(
    native: NativeKernels, compact_format: str, rows: int
) -> None:
    check_against_float64(native, compact_format, rows, 71, 160, prepare=native.with_panels)


@pytest.mark.parametrize("compact_format", ["q8_0", "q4_1"])
@pytest.mark.parametrize("rows", [5, 16])
def test_long_weight_rows(native: NativeKernels, compact_format: str, rows: int) -> None:
    check_against_float64(native, compact_format, rows, 20, 5472, prepare=native.with_panels)


def test_the_panels_take_batches_from_their_row_minimum(native: NativeKernels) -> None:
    """Panels packed from another weight than the stored rows show which one a batch read."""
    rng = np.random.default_rng(3)
    stored, stored_values = _stored(rng, "q8_0", 32, 64)
    other, other_values = _stored(rng, "q8_0", 32, 64)
    mixed = CompactWeight("q8_0", stored.data, 64, panels=native.with_panels(other).panels)
    for rows, values in ((PANEL_MIN_ROWS - 1, stored_values), (PANEL_MIN_ROWS, other_values)):
        x = torch.eye(64)[:rows]
        assert torch.equal(native.gemv(x, mixed, None), values.T[:rows])


def test_a_layer_sends_batches_up_to_the_panels_row_maximum_to_them(native: NativeKernels) -> None:
    """A layer whose GEMM weight, stored rows and panels are three different weights: each batch
    shows which one multiplied it. Past COMPACT_MAX_ROWS the panels keep batches (prefill chunks,
    mixed batches) up to PANELS_MAX_ROWS; the GEMM takes larger ones, and without panels every
    batch past COMPACT_MAX_ROWS."""
    rng = np.random.default_rng(4)
    stored, stored_values = _stored(rng, "q8_0", 32, 64)
    other, panel_values = _stored(rng, "q8_0", 32, 64)
    gemm_values = torch.from_numpy(rng.normal(size=(32, 64)).astype(np.float32))
    layer = Linear(64, 32, bias=False, dtype=torch.float32, device="cpu")
    layer.weight.data.copy_(gemm_values)
    layer.native = native
    layer.compact = CompactWeight("q8_0", stored.data, 64, panels=native.with_panels(other).panels)
    one_hot = torch.eye(64).repeat(3, 1)  # each row picks one input: exact in every kernel
    for rows, values in (
        (COMPACT_MAX_ROWS + 1, panel_values),
        (PANELS_MAX_ROWS, panel_values),
        (PANELS_MAX_ROWS + 1, gemm_values),
    ):
        assert torch.equal(layer(one_hot[:rows]), (one_hot[:rows] @ values.T)), rows
    layer.compact = stored
    assert torch.equal(
        layer(one_hot[:COMPACT_MAX_ROWS]), one_hot[:COMPACT_MAX_ROWS] @ stored_values.T
    )
    rows = COMPACT_MAX_ROWS + 1
    assert torch.equal(layer(one_hot[:rows]), one_hot[:rows] @ gemm_values.T)


def test_only_block_weights_get_panels(native: NativeKernels) -> None:
    bf16 = CompactWeight.from_tensor(torch.randn(16, 32, dtype=torch.bfloat16))
    assert bf16 is not None
    with pytest.raises(ValueError, match="not kept in panels"):
        native.with_panels(bf16)
    q4, _ = _stored(np.random.default_rng(5), "q4_0", 16, 32)
    with pytest.raises(ValueError, match="AVX-512 only"):
        load_native_kernels(avx512=False).with_panels(q4)
