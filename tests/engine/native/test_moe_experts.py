"""The native expert kernel (moe_experts.c) against a dense float64 reference, for every stored
format: a batch whose tokens hit disjoint experts, one where all hit the same, a single decode
row and a prefill's many (past the compact kernels' rows, multiplied a slab at a time); and a
mixture-of-experts block holding stored experts computes what its float32 twin does."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers.compact_reference import stored_weight
from helpers.native_cache import use_private_cache

from baton.checkpoint.moe_config import MoEConfig
from baton.engine.cpu.capabilities import detect_cpu_capabilities
from baton.engine.models.moe import SparseMoE
from baton.engine.native.formats import FORMATS
from baton.engine.native.library import NativeKernels, load_native_kernels
from baton.engine.native.structs import ExpertMatrices
from baton.hardware import isa_rank

pytestmark = pytest.mark.skipif(
    isa_rank(detect_cpu_capabilities().isa) < isa_rank("avx2") or shutil.which("cc") is None,
    reason="the native kernel needs an AVX2 CPU and a C compiler",
)
EXPERTS, HIDDEN, FEATURES, TOP_K = 6, 256, 256, 2  # whole blocks of every format (256)


@pytest.fixture(autouse=True)
def private_cache(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    use_private_cache(tmp_path_factory, monkeypatch)


@pytest.fixture(scope="module")
def native() -> NativeKernels:
    return load_native_kernels()


def stored_experts(
    compact_format: str, native: NativeKernels, seed: int = 0
) -> tuple[ExpertMatrices, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Random experts stored in `compact_format`, and each one's ([gate | up], down) values."""
    rng = np.random.default_rng(seed)
    stored: tuple[list, list, list] = ([], [], [])
    values = []
    for _ in range(EXPERTS):
        parts = [
            stored_weight(rng.normal(size=shape).astype(np.float32) * 0.1, compact_format)
            for shape in ((FEATURES, HIDDEN), (FEATURES, HIDDEN), (HIDDEN, FEATURES))
        ]
        for weights, (compact, _) in zip(stored, parts):
            weights.append(compact)
        values.append((torch.cat([parts[0][1], parts[1][1]]), parts[2][1]))
    return ExpertMatrices(*stored, native.avx512), values


def reference(
    x: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    values: list[tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor:
    """Token by token, each chosen expert's gated MLP in float64, weighted and summed."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for token, row in enumerate(x.double()):
        for expert, weight in zip(experts[token].tolist(), weights[token].double()):
            gate_up, down = (v.double() for v in values[expert])
            gate, up = (row @ gate_up.T).split(FEATURES)
            out[token] += weight * (down @ (F.silu(gate) * up))
    return out


def routing(rows: int, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's TOP_K experts and weights: all rows the same two experts, or each row a
    pair of its own (disjoint from its neighbours')."""
    generator = torch.Generator().manual_seed(rows)
    if kind == "same":
        experts = torch.tensor([[4, 1]] * rows)
    else:
        experts = torch.stack(
            [torch.tensor([(2 * r) % EXPERTS, (2 * r + 1) % EXPERTS]) for r in range(rows)]
        )
    weights = torch.softmax(torch.randn(rows, TOP_K, generator=generator), dim=-1)
    return experts, weights


# Up to 16 rows of its busiest expert, a batch's experts are shared out among the threads, each
# expert's products on one (moe_experts.c, EXPERTS_APART_MAX_ROWS); past it, each product among
# them: 16 rows on the same experts are the last batch of the first kind, 17 the first of the
# second.
@pytest.mark.parametrize("compact_format", sorted(FORMATS))
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 40])
@pytest.mark.parametrize("kind", ["disjoint", "same"])
def test_the_kernel_is_the_dense_float64_reference(
    native: NativeKernels, compact_format: str, rows: int, kind: str
) -> None:
    stored, values = stored_experts(compact_format, native)
    x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(7))
    experts, weights = routing(rows, kind)
    out = native.moe_experts(x, experts, weights, stored)
    expected = reference(x, experts, weights, values)
    # float32 sums of a few hundred terms each, twice over: 1e-4 of the output's scale.
    scale = expected.abs().max()
    assert float((out.double() - expected).abs().max() / scale) < 1e-4


def test_an_expert_id_out_of_range_is_refused(native: NativeKernels) -> None:
    stored, _ = stored_experts("q8_0", native)
    x = torch.randn(2, HIDDEN)
    experts, weights = torch.tensor([[0, 1], [2, EXPERTS]]), torch.full((2, TOP_K), 0.5)
    with pytest.raises(MemoryError):
        native.moe_experts(x, experts, weights, stored)


@pytest.mark.parametrize("shared", [0, 96])
def test_a_block_holding_stored_experts_computes_its_float32_twins_output(
    native: NativeKernels, shared: int
) -> None:
    """Routing, renormalisation and the shared expert stay the block's; only the experts'
    products move to the kernel (bf16 weights: exact in float32, the same values)."""
    moe = MoEConfig(
        EXPERTS, TOP_K, FEATURES, normalize_top_k=not shared, shared_intermediate_size=shared
    )
    stored, values = stored_experts("bf16", native)
    twin = SparseMoE(HIDDEN, moe, torch.float32, "cpu")
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in twin.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
        for expert, (gate_up, down) in enumerate(values):
            twin.experts_gate_up[expert].copy_(gate_up)
            twin.experts_down[expert].copy_(down)
    block = SparseMoE(HIDDEN, moe, torch.float32, "cpu")
    block.load_state_dict(twin.state_dict())
    block.hold_stored_experts(stored, native)
    assert block.experts_gate_up.numel() == 0 and block.experts_down.numel() == 0
    x = torch.randn(40, HIDDEN, generator=generator)
    with torch.no_grad():
        expected, out = twin(x), block(x)
    assert float((out - expected).abs().max() / expected.abs().max()) < 1e-5
