"""A mixture-of-experts block (Qwen2-MoE, Qwen3-MoE, Mixtral): a softmax router picks each
token's top-k experts, and each expert the batch chose runs once, over the tokens routed to it.

The experts' weights are held stacked ([experts, 2 x intermediate, hidden] gate and up,
[experts, hidden, intermediate] down), so an expert's are one slice, read once a batch however
many of its tokens chose it; experts no token chose are not read at all, which is what makes a
model of few active parameters fast where bandwidth is scarce.

With several tensor-parallel ranks each rank holds an equal share of whole experts (expert
parallelism, as vLLM's `--enable-expert-parallel`: a GGUF's blocks need no cutting, and a rank
reads only its own experts), routes every token over all of them, multiplies the assignments
to its own and the ranks add their partial sums; a shared expert joins on the first rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from baton.checkpoint.moe_config import MoEConfig
from baton.distributed.tensor_parallel import TensorParallel
from baton.engine.models.layers import empty_parameter
from baton.engine.models.mlp import GatedMLP
from baton.engine.models.parallel_layers import all_reduce_sum
from baton.engine.native.library import NativeKernels
from baton.engine.native.structs import ExpertMatrices


class SparseMoE(nn.Module):
    """Routed experts, and a gated shared expert where the model has one (Qwen2-MoE)."""

    def __init__(
        self,
        hidden_size: int,
        moe: MoEConfig,
        dtype: torch.dtype,
        device: torch.device | str,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        self.moe = moe
        self.tp = tp if tp is not None and tp.size > 1 else None
        # The experts this rank holds, [first, first + count): all of them in one process.
        self.held = self.tp.share(moe.num_experts, "experts") if self.tp else (0, moe.num_experts)
        features, count = moe.expert_intermediate_size, self.held[1]
        # A plain weight, not a Linear: never packed for oneDNN, so the native decode step
        # reads it as it is (a few hundred KB a layer: no compact copy to speak of).
        self.router = empty_parameter(moe.num_experts, hidden_size, dtype=dtype, device=device)
        self.experts_gate_up = empty_parameter(
            count, 2 * features, hidden_size, dtype=dtype, device=device
        )
        self.experts_down = empty_parameter(
            count, hidden_size, features, dtype=dtype, device=device
        )
        shared = moe.shared_intermediate_size if self.tp is None or self.tp.rank == 0 else 0
        self.shared_expert = GatedMLP(hidden_size, shared, False, dtype, device) if shared else None
        # [1, hidden], plain as the router is (and read as it is by the native decode step).
        self.shared_expert_gate = (
            empty_parameter(1, hidden_size, dtype=dtype, device=device) if shared else None
        )
        self.native: NativeKernels | None = None  # (CausalLM.use_native_kernels sets it)
        # The experts as the checkpoint stores them (`hold_stored_experts`): every batch's
        # experts then run in the native kernel, and the stacked parameters are freed.
        self.stored: ExpertMatrices | None = None

    def hold_stored_experts(self, stored: ExpertMatrices, native: NativeKernels) -> None:
        """Multiply the experts from their stored weights only (moe_experts.c reads each
        expert's compact weight: GGUF blocks, bf16, f16), freeing the stacked float32 ones."""
        if stored.num_experts != self.held[1]:
            raise ValueError(f"{stored.num_experts} stored experts for {self.held[1]}")
        self.stored, self.native = stored, native
        for name in ("experts_gate_up", "experts_down"):
            setattr(self, name, nn.Parameter(torch.empty(0), requires_grad=False))

    def add_to(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """`residual + self(x)`, in `residual`'s memory: the decoder layer's way in."""
        return residual.add_(self(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[tokens, hidden] -> [tokens, hidden]: each token's experts' outputs weighted by their
        routing probabilities, summed expert by expert in ascending order (as transformers
        sums them), then the shared expert's."""
        weights, experts = self.route(x)
        if self.tp is not None:
            first, count = self.held
            local = experts - first
            # -1: another rank's expert (moe_experts.c and _experts leave it out).
            experts = torch.where((local >= 0) & (local < count), local, -1)
        if self.stored is not None:
            out = self.native.moe_experts(x, experts, weights, self.stored)
        else:
            out = self._experts(x, weights, experts)
        if self.shared_expert is not None:
            out += torch.sigmoid(F.linear(x, self.shared_expert_gate)) * self.shared_expert(x)
        return out if self.tp is None else all_reduce_sum(self.tp, out)

    def _experts(
        self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
    ) -> torch.Tensor:
        """The routed experts this rank holds (`experts`: their indices among them, -1 for
        another rank's) from the stacked parameters: the (token, choice) pairs sorted by expert
        and each matrix multiplied in one grouped product (torch's grouped_mm: CUTLASS's grouped
        GEMM for bf16 on CUDA sm90+), each expert's slice once over its rows. Nothing else here
        reads a tensor on the host, so with CUTLASS's product a CUDA graph records the block
        whole (torch's fallback for other dtypes reads the group ends on the host)."""
        tokens, top_k = experts.shape
        count, features = self.held[1], self.moe.expert_intermediate_size
        # Each token's choices in ascending expert order, another rank's (as `count`) last:
        # the sum below then adds a token's products as transformers does, expert by expert.
        chosen, choice_order = torch.where(experts >= 0, experts, count).sort(dim=-1)
        pair_weights = weights.gather(1, choice_order).flatten()
        expert_of_row, order = chosen.flatten().sort(stable=True)
        # Group e's rows end where the sorted experts pass e; another rank's pairs lie past
        # the last group, unmultiplied (their rows are masked out below).
        ends = torch.searchsorted(
            expert_of_row, torch.arange(count, device=x.device), right=True
        ).to(torch.int32)
        gate_up = F.grouped_mm(x[order // top_k], self.experts_gate_up.transpose(1, 2), offs=ends)
        activated = F.silu(gate_up[:, :features]) * gate_up[:, features:]
        product = F.grouped_mm(activated, self.experts_down.transpose(1, 2), offs=ends)
        product = (product * pair_weights[order, None]).to(x.dtype)
        product = torch.where((expert_of_row < count)[:, None], product, 0)
        by_choice = torch.empty_like(product).index_copy_(0, order, product)
        by_choice = by_choice.view(tokens, top_k, -1)
        out = by_choice[:, 0]
        for choice in range(1, top_k):
            out = out + by_choice[:, choice]
        return out

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k experts, most likely first ([tokens, k]), and their weights: the
        router's float32 softmax probabilities, renormalised over the k where the model says,
        in the activations' dtype or float32 (`MoEConfig.float32_weights`)."""
        logits = F.linear(x, self.router)
        probabilities = torch.softmax(logits.float(), dim=-1)
        weights, experts = torch.topk(probabilities, self.moe.top_k, dim=-1)
        if self.moe.normalize_top_k:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if self.moe.float32_weights else weights.to(logits.dtype)), experts
