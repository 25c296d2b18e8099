"""The attention-backend interface: one per engine, planned once per batch, called per layer."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from baton.engine.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    """Computes causal attention of a ragged batch against the paged KV cache.

    The caller writes the batch's new K/V into the cache (`KVPool.write`) before `forward`, so
    every row attends over `meta.kv_lens[i]` cached tokens, the new ones included; new token j of
    row i sits at position `kv_lens[i] - q_lens[i] + j` and sees keys at positions <= its own.
    """

    @abstractmethod
    def plan(self, meta: AttentionMetadata) -> None:
        """Prepare per-batch state (index tensors, kernel plans); called once before the layers."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Attention for one layer.

        q: [tokens, num_q_heads, head_dim]; k_cache/v_cache: [num_pages, page_size,
        num_kv_heads, head_dim]. Returns [tokens, num_q_heads, head_dim] in q's dtype. Query
        heads are grouped over KV heads (GQA) without materialising repeated K/V. `window`: a
        query at position p sees the keys at p - window + 1 .. p only (ModelConfig.layer_windows);
        `softcap`: the scaled scores are soft-capped (`soft_cap`) before the softmax.
        """


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """`cap * tanh(x / cap)`, in place: Gemma 2's attention scores (before the mask and the
    softmax) and final logits, in transformers' order of operations."""
    return x.div_(cap).tanh_().mul_(cap)
