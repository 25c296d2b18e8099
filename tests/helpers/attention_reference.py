"""Paged attention's reference: per-row causal softmax attention in float64, on q's device."""

from __future__ import annotations

import torch

from baton.engine.attention.metadata import AttentionMetadata


def dense_reference(
    q: torch.Tensor,
    meta: AttentionMetadata,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    scale: float,
) -> torch.Tensor:
    """Each row's queries (q's rows in order, `meta.q_lens` each) over its own contiguous K/V
    ([kv_len, kv_heads, head_dim] per row), the last q_len of its kv_len positions, causally."""
    outputs = []
    start = 0
    for n, kv_len, k, v in zip(meta.q_lens, meta.kv_lens, keys, values, strict=True):
        row_q = q[start : start + n].double()
        start += n
        group = q.shape[1] // k.shape[1]
        k_full = k.to(q.device, torch.float64).repeat_interleave(
            group, dim=1
        )  # [kv_len, q_heads, d]
        v_full = v.to(q.device, torch.float64).repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", row_q, k_full) * scale
        query_pos = torch.arange(kv_len - n, kv_len, device=q.device).unsqueeze(1)
        key_pos = torch.arange(kv_len, device=q.device).unsqueeze(0)
        scores = scores.masked_fill(key_pos > query_pos, float("-inf"))
        outputs.append(torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v_full))
    return torch.cat(outputs)
