"""Mixtures of experts (Qwen3-MoE, Qwen2-MoE with its shared expert, Mixtral): greedy tokens as
transformers' through the whole engine; the block against a float64 reference when a batch's
tokens hit disjoint experts and when all hit the same; routing, ties included, as transformers
routes; what is not built refused in one line."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import assert_greedy_matches_hf
from helpers.moe_reference import HIDDEN, block, reference, routed_to
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from baton import LLM, SamplingParams
from baton.checkpoint.load import load_checkpoint
from baton.checkpoint.moe_config import MoEConfig
from baton.distributed.tensor_parallel import TensorParallel
from baton.engine.models.moe import SparseMoE
from baton.engine.models.parallel_layers import ModelShards

VARIANTS = ("qwen3_moe", "qwen2_moe", "mixtral")
PROMPTS = [[(7 * j + 3) % 250 for j in range(30)], [(5 * j + 1) % 250 for j in range(9)]]
# The experts' widths in whole multiples of the compact kernels' 32 inputs.
BF16_WIDTHS = {
    "qwen3_moe": {"moe_intermediate_size": 64},
    "qwen2_moe": {"moe_intermediate_size": 64, "shared_expert_intermediate_size": 96},
    "mixtral": {"intermediate_size": 64},
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_tokens_are_transformers(
    tiny_model_factory: Callable[..., Path], variant: str
) -> None:
    """Two prompts in chunks of 8 beside each other's decode rows: every batch routes tokens of
    both, so the experts' grouping mixes requests."""
    model_dir = tiny_model_factory(variant)
    llm = LLM(str(model_dir), dtype="float32", chunk_size=8, page_size=4)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for prompt, output in zip(PROMPTS, llm.generate(PROMPTS, params)):
        assert len(output.token_ids) == 12
        assert_greedy_matches_hf(model_dir, prompt, output.token_ids)


def test_the_configs_name_their_experts(tiny_model_factory: Callable[..., Path]) -> None:
    qwen3 = load_checkpoint(str(tiny_model_factory("qwen3_moe"))).config.moe
    assert (qwen3.num_experts, qwen3.top_k, qwen3.normalize_top_k) == (6, 2, True)
    assert qwen3.dense_layers == frozenset({1}) and qwen3.shared_intermediate_size == 0
    qwen2 = load_checkpoint(str(tiny_model_factory("qwen2_moe"))).config.moe
    assert (qwen2.top_k, qwen2.normalize_top_k, qwen2.shared_intermediate_size) == (3, False, 80)
    assert qwen2.dense_layers == frozenset({0, 2})  # decoder_sparse_step 2: layer 1 is sparse
    mixtral = load_checkpoint(str(tiny_model_factory("mixtral"))).config.moe
    assert (mixtral.prefix, mixtral.expert_names) == ("block_sparse_moe", ("w1", "w3", "w2"))
    assert mixtral.float32_weights and mixtral.normalize_top_k


@pytest.mark.parametrize("shared", [0, 24])
@pytest.mark.parametrize(
    "experts_of_token",
    [
        [[0, 1], [2, 3], [4, 5]],  # disjoint: each expert runs for one token
        [[3, 1], [3, 1], [3, 1], [3, 1]],  # all the same: two experts over every token
    ],
)
def test_the_block_is_its_definition(experts_of_token: list[list[int]], shared: int) -> None:
    moe = MoEConfig(6, 2, 12, normalize_top_k=bool(shared), shared_intermediate_size=shared)
    tokens, router = routed_to(experts_of_token, 6)
    module = block(moe, router)
    assert module.route(tokens)[1].tolist() == experts_of_token
    torch.testing.assert_close(module(tokens).double(), reference(module, tokens))


def test_routing_ties_and_order_are_transformers() -> None:
    """Tied router logits (equal rows) pick the experts, in the order, transformers' router
    does, with the same weights, renormalised or not."""
    router = torch.randn(8, HIDDEN, generator=torch.Generator().manual_seed(1))
    router[5] = router[2]  # a tie between experts 2 and 5 for every token
    router[7] = router[2]
    x = torch.randn(6, HIDDEN, generator=torch.Generator().manual_seed(2))
    for normalize in (False, True):
        config = Qwen3MoeConfig(
            hidden_size=HIDDEN, num_experts=8, num_experts_per_tok=3, norm_topk_prob=normalize
        )
        theirs = Qwen3MoeTopKRouter(config)
        with torch.no_grad():
            theirs.weight.copy_(router)
        _, their_weights, their_experts = theirs(x)
        module = block(MoEConfig(8, 3, 4, normalize_top_k=normalize), router)
        weights, experts = module.route(x)
        assert experts.tolist() == their_experts.tolist()
        torch.testing.assert_close(weights, their_weights, rtol=0, atol=0)


def test_each_rank_holds_its_share_of_whole_experts(
    tiny_model_factory: Callable[..., Path],
) -> None:
    """Two ranks of the tiny Qwen3-MoE's six experts: three each, the router over all six (the
    tokens: tests/engine/distributed/test_tensor_parallel_engine.py)."""
    config = load_checkpoint(str(tiny_model_factory("qwen3_moe"))).config
    for rank, first in ((0, 0), (1, 3)):
        tp = TensorParallel(rank=rank, size=2)
        ModelShards.of(config, tp)  # (no refusal)
        block = SparseMoE(config.hidden_size, config.moe, torch.float32, "cpu", tp)
        assert block.held == (first, 3)
        assert block.experts_gate_up.shape[0] == block.experts_down.shape[0] == 3
        assert block.router.shape[0] == 6


@pytest.mark.parametrize("variant", VARIANTS)
def test_bf16_experts_are_multiplied_as_stored(
    tiny_model_factory: Callable[..., Path], variant: str
) -> None:
    """A bf16 checkpoint computed in float32: every sparse layer multiplies its experts' bf16
    weights in the native expert kernel (no float32 stack kept), tokens as transformers'."""
    model_dir = tiny_model_factory(variant, weights_dtype=torch.bfloat16, **BF16_WIDTHS[variant])
    llm = LLM(str(model_dir), dtype="float32", chunk_size=8, page_size=4)
    blocks = [layer.mlp for layer in llm.engine.model.layers if isinstance(layer.mlp, SparseMoE)]
    if llm.engine.model.layers[0].self_attn.native is None:
        pytest.skip("the native kernels need an AVX2 CPU and a C compiler")
    assert blocks and all(block.stored is not None for block in blocks)
    assert all(block.experts_gate_up.numel() == 0 for block in blocks)
    assert {w.format for block in blocks for ws in block.stored.weights for w in ws} == {"bf16"}
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for prompt, output in zip(PROMPTS, llm.generate(PROMPTS, params)):
        assert_greedy_matches_hf(model_dir, prompt, output.token_ids)
