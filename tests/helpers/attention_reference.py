"""Paged attention's test batches (K/V in scattered pages) and its reference: per-row causal
softmax attention in float64, on q's device."""

from __future__ import annotations

import torch

from baton.engine.attention.metadata import AttentionMetadata, build_attention_metadata
from baton.engine.kv_pool import KVPool


def scattered_batch(
    rows: list[tuple[int, int]],
    page_size: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    generator: torch.Generator,
    device: torch.device | str = "cpu",
) -> tuple[KVPool, AttentionMetadata, list[torch.Tensor], list[torch.Tensor]]:
    """Every row's (cached prefix, new tokens) K/V written into randomly scattered pages of a
    pool on `device`, as earlier steps would have written them; the batch's metadata, and each
    row's contiguous K/V (on the CPU) for the reference."""
    kv_lens = [prefix + n for prefix, n in rows]
    pages_needed = [-(-kv_len // page_size) + 1 for kv_len in kv_lens]  # +1: unused spare page
    num_pages = 3 * sum(pages_needed)
    free = torch.randperm(num_pages, generator=generator).tolist()
    tables = []
    for count in pages_needed:
        tables.append(free[:count])
        free = free[count:]
    pool = KVPool(1, num_pages, page_size, kv_heads, head_dim, dtype, device)
    keys = [torch.randn(n, kv_heads, head_dim, generator=generator).to(dtype) for n in kv_lens]
    values = [torch.randn(n, kv_heads, head_dim, generator=generator).to(dtype) for n in kv_lens]
    fill = build_attention_metadata([0] * len(rows), kv_lens, tables, page_size, device)
    pool.write(0, torch.cat(keys).to(device), torch.cat(values).to(device), fill.slot_mapping)
    meta = build_attention_metadata(
        [prefix for prefix, _ in rows], [n for _, n in rows], tables, page_size, device
    )
    return pool, meta, keys, values


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
