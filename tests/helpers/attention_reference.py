"""Paged attention's test batches (K/V in scattered pages) and its reference: per-row causal
softmax attention in float64, on q's device; and one prefill row as the native kernels take it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from baton.engine.attention.metadata import AttentionMetadata, build_attention_metadata
from baton.engine.kv.pool import KVPool
from baton.engine.native.library import NativeKernels


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
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Each row's queries (q's rows in order, `meta.q_lens` each) over its own contiguous K/V
    ([kv_len, kv_heads, head_dim] per row), the last q_len of its kv_len positions, causally;
    over the keys after p - window only, and soft-capped, where given (transformers' Gemma 2)."""
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
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        query_pos = torch.arange(kv_len - n, kv_len, device=q.device).unsqueeze(1)
        key_pos = torch.arange(kv_len, device=q.device).unsqueeze(0)
        hidden = (key_pos > query_pos) | (key_pos <= query_pos - (window or kv_len + 1))
        scores = scores.masked_fill(hidden, float("-inf"))
        outputs.append(torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v_full))
    return torch.cat(outputs)


@dataclass(frozen=True)
class PrefillRow:
    """One prefill row as the native kernels take it: q [q_len, heads, head_dim] strided as the
    model's qkv product holds it, the caches [slots, kv_heads, head_dim] with the row's keys in
    scattered slots, kv_rows (the backend's head-major list of cache rows, slot * kv_heads +
    head), and the row's keys and values [kv_heads, prefix + q_len, head_dim] in order."""

    q: torch.Tensor
    prefix: int
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    kv_rows: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor


def scattered_prefill_row(
    q_len: int, prefix: int, heads: int, kv_heads: int, head_dim: int
) -> PrefillRow:
    """A random prefill row of `q_len` queries after `prefix` cached keys (seeded by its shape)."""
    generator = torch.Generator().manual_seed(q_len + prefix + head_dim)
    keys, slots = prefix + q_len, 2 * (prefix + q_len) + 5
    k_cache = torch.randn(slots, kv_heads, head_dim, generator=generator)
    v_cache = torch.randn(slots, kv_heads, head_dim, generator=generator)
    slot_of = torch.randperm(slots, generator=generator)[:keys]
    kv_rows = (slot_of[None, :] * kv_heads + torch.arange(kv_heads)[:, None]).reshape(-1)
    qkv = torch.randn(q_len, heads * head_dim + 24, generator=generator)
    q = qkv[:, : heads * head_dim].view(q_len, heads, head_dim)
    k, v = k_cache[slot_of].transpose(0, 1), v_cache[slot_of].transpose(0, 1)
    return PrefillRow(q, prefix, k_cache, v_cache, kv_rows, k, v)


def attend_prefill_row(
    native: NativeKernels,
    row: PrefillRow,
    on_amx: bool,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The native kernel's output for `row`, written between two rows it must leave alone."""
    q_len, heads, head_dim = row.q.shape
    out = torch.full((q_len + 2, heads, head_dim), torch.nan)
    native.prefill_attention(
        row.q, row.prefix, row.k_cache, row.v_cache, row.kv_rows, head_dim**-0.5, out[1:-1],
        on_amx=on_amx, window=window, softcap=softcap,
    )  # fmt: skip
    assert out[0].isnan().all() and out[-1].isnan().all()
    return out[1:-1]


def causal_float64(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix: int,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention in float64 of q [q_len, heads, d] over k/v [kv_heads, keys, d], the
    queries after `prefix` keys, scaled by d^-1/2; a query at position p sees keys after
    p - window only, and scores are soft-capped, where given (transformers' Gemma 2)."""
    q_len, heads, head_dim = q.shape
    group = heads // k.shape[0]
    q, k, v = (t.double() for t in (q, k, v))
    behind = (prefix + torch.arange(q_len))[:, None] - torch.arange(k.shape[1])[None, :]
    hidden = (behind < 0) | (behind >= (window or k.shape[1] + 1))
    out = torch.empty(q_len, heads, head_dim, dtype=torch.float64)
    for head in range(heads):
        scores = q[:, head] @ k[head // group].T * head_dim**-0.5
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        out[:, head] = torch.softmax(scores.masked_fill(hidden, -torch.inf), -1) @ v[head // group]
    return out


def flash_error(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, want: torch.Tensor) -> float:
    """torch's causal flash kernel's largest error against `want`, on these operands' dtype."""
    flash = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), is_causal=True,
        enable_gqa=True,
    )  # fmt: skip
    return float((flash[0].transpose(0, 1).double() - want).abs().max())
