"""Mixtures of experts on a CUDA GPU: the block's grouped products (torch's grouped_mm) against
its float64 definition with no host synchronisation in it, and decode graphs recorded over the
whole model, greedy token for token as the same engine run eagerly. Skips without a CUDA GPU
(CI has none); `scripts/gpu/run_cuda_checks.sh` runs it on a GPU machine."""

from __future__ import annotations

import random

import pytest
import torch
from helpers.cuda_runs import greedy_graphed_and_eager
from helpers.moe_reference import block, reference, routed_to

from baton import SamplingParams
from baton.checkpoint.moe_config import MoEConfig
from baton.engine.attention.flashinfer_backend import flashinfer_available

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
# bf16 products of 16 inputs, then 16 (the block's widths), against float64 on the same
# bf16-rounded weights: a few units in bf16's last place of outputs of size ~1.
BF16_TOLERANCE = 3e-2


@pytest.mark.parametrize("shared", [0, 24])
@pytest.mark.parametrize(
    "experts_of_token",
    [[[0, 1], [2, 3], [4, 5]], [[3, 1], [3, 1], [3, 1], [3, 1]], [[5, 0], [0, 5], [2, 0]]],
)
def test_the_block_runs_on_the_gpu_without_a_host_sync(
    experts_of_token: list[list[int]], shared: int
) -> None:
    """Disjoint experts, all tokens on the same two, and choices in both orders; under
    `torch.cuda.set_sync_debug_mode("error")`, which raises on any device-to-host wait."""
    moe = MoEConfig(6, 2, 16, normalize_top_k=bool(shared), shared_intermediate_size=shared)
    tokens, router = routed_to(experts_of_token, 6)
    module = block(moe, router)
    with torch.no_grad():
        for param in module.parameters():  # the GPU's weights, exactly, for the reference
            param.copy_(param.bfloat16().float())
    expected = reference(module, tokens)
    module = module.to("cuda", torch.bfloat16)
    x = tokens.to("cuda", torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.inference_mode():
            out = module(x)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(
        out.double().cpu(), expected, atol=BF16_TOLERANCE, rtol=BF16_TOLERANCE
    )


# (head_dim 128: the FlashInfer kernels scripts/gpu/flashinfer_warmup.py builds first; the name
# puts the test among the FlashInfer ones run_cuda_checks.sh runs once they are built.)
@pytest.mark.parametrize("variant", ["qwen3_moe", "mixtral"])
def test_flashinfer_moe_graphs_decode_as_eager_steps_bf16_hd128(
    tiny_model_factory, variant: str
) -> None:
    """Every decode step of a mixture of experts replays a recorded graph (the experts' grouped
    products inside it), greedy tokens as --enforce-eager's, prompts of ragged lengths."""
    if not flashinfer_available():
        pytest.skip("flashinfer is not importable here")
    model_dir = tiny_model_factory(variant, head_dim=128)
    rng = random.Random(len(variant))
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(1, 90))] for _ in range(5)]
    graphed, eager = greedy_graphed_and_eager(model_dir, prompts, GREEDY, cuda_graph_max_bs=8)
    assert graphed == eager
