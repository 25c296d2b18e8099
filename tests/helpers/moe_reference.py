"""A mixture-of-experts block with seeded experts, and the block in float64 from its
definition, token by token and expert by expert: tests/engine/models/test_moe.py on the CPU,
tests/cuda/test_cuda_moe.py on a GPU."""

from __future__ import annotations

import torch

from baton.checkpoint.moe_config import MoEConfig
from baton.engine.models.moe import SparseMoE

HIDDEN = 16


def block(moe: MoEConfig, router: torch.Tensor, seed: int = 0) -> SparseMoE:
    """A float32 block with seeded experts and the given router weights."""
    generator = torch.Generator().manual_seed(seed)
    module = SparseMoE(HIDDEN, moe, torch.float32, "cpu")
    with torch.no_grad():
        module.router.copy_(router)
        for param in (module.experts_gate_up, module.experts_down):
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
        if module.shared_expert is not None:
            for param in (
                module.shared_expert.gate_up_proj.weight,
                module.shared_expert.down_proj.weight,
                module.shared_expert_gate,
            ):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return module


def reference(module: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """The block in float64, token by token, expert by expert, from its definition."""
    moe, out = module.moe, torch.zeros(x.shape, dtype=torch.float64)
    features = moe.expert_intermediate_size
    gate_up = module.experts_gate_up.double()
    down = module.experts_down.double()
    for token, row in enumerate(x.double()):
        probabilities = torch.softmax(module.router.double() @ row, dim=-1)
        chosen = torch.argsort(probabilities, descending=True)[: moe.top_k]
        weights = probabilities[chosen]
        if moe.normalize_top_k:
            weights = weights / weights.sum()
        for expert, weight in zip(chosen.tolist(), weights):
            hidden = gate_up[expert] @ row
            activated = torch.nn.functional.silu(hidden[:features]) * hidden[features:]
            out[token] += weight * (down[expert] @ activated)
        if module.shared_expert is not None:
            shared = module.shared_expert
            hidden = shared.gate_up_proj.weight.double() @ row
            size = moe.shared_intermediate_size
            activated = torch.nn.functional.silu(hidden[:size]) * hidden[size:]
            gate = torch.sigmoid(module.shared_expert_gate.double() @ row)
            out[token] += gate * (shared.down_proj.weight.double() @ activated)
    return out


def routed_to(experts_of_token: list[list[int]], num_experts: int) -> tuple[torch.Tensor, ...]:
    """Tokens and router weights such that token i's router logits are highest, in order, at
    `experts_of_token[i]` (one-hot tokens; each expert's router row reads its tokens' axes)."""
    tokens = torch.eye(len(experts_of_token), HIDDEN)
    router = torch.zeros(num_experts, HIDDEN)
    for token, experts in enumerate(experts_of_token):
        for rank, expert in enumerate(experts):
            router[expert, token] = 4.0 - rank
    return tokens, router
