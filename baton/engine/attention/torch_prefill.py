"""A prefill row's attention in torch (torch_backend.py's rows that no native kernel takes):
torch's flash kernel where the row is plainly causal, else blocks of queries under an explicit
mask, which also bounds a sliding window (ModelConfig.layer_windows), and, with Gemma 2's
soft-capped scores, a matmul-softmax-matmul of each block (no fused kernel caps scores).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from baton.engine.attention.base import soft_cap


@dataclass(frozen=True)
class PrefillRow:
    """One row with several queries, attended with a causal mask offset by its cached prefix."""

    q_start: int
    q_len: int
    kv_len: int
    kv_rows: torch.Tensor  # [kv_heads * kv_len] rows of the cache viewed [-1, head_dim]
    block: int  # queries per masked block

    def windowed(self, window: int | None) -> bool:
        """Whether `window` hides some key from some query of the row (the last query sees
        kv_len keys)."""
        return window is not None and window < self.kv_len


@dataclass(frozen=True)
class PrefillShape:
    """The heads and the dtype a row attends in, and the keys' visibility triangle: True on and
    below the diagonal (the keys a block's queries see past the prefix), at least a block."""

    kv_heads: int
    group: int
    dtype: torch.dtype
    visible: torch.Tensor


def attend_prefill_row(
    q: torch.Tensor,
    k_rows: torch.Tensor,
    v_rows: torch.Tensor,
    row: PrefillRow,
    scale: float,
    out: torch.Tensor,
    shape: PrefillShape,
    window: int | None = None,
    softcap: float | None = None,
) -> None:
    """Row `row` of q [tokens, q_heads, head_dim] over its keys (rows of the caches viewed
    [-1, head_dim]) into `out`; see AttentionBackend.forward for `window` and `softcap`."""
    kv_heads, group, head_dim = shape.kv_heads, shape.group, q.shape[-1]
    # [1, kv_heads, keys, head_dim]: the fused kernel's layout (batch first, as it requires).
    k = k_rows.index_select(0, row.kv_rows).to(shape.dtype)
    v = v_rows.index_select(0, row.kv_rows).to(shape.dtype)
    k, v = (x.view(1, kv_heads, row.kv_len, head_dim) for x in (k, v))
    row_q = q[row.q_start : row.q_start + row.q_len].to(shape.dtype)
    prefix = row.kv_len - row.q_len
    windowed = row.windowed(window)
    if prefix == 0 and q.device.type == "cpu" and not windowed and softcap is None:
        # The CPU flash kernel (grouped KV heads since torch 2.9) holds a block of scores at a
        # time, and its causal mask is this row's: it skips the future keys' blocks.
        tokens = slice(row.q_start, row.q_start + row.q_len)
        attended = F.scaled_dot_product_attention(
            row_q.transpose(0, 1).unsqueeze(0),
            k,
            v,
            is_causal=True,
            scale=scale,
            enable_gqa=group > 1,
        )
        out[tokens].copy_(attended[0].transpose(0, 1))
        return
    # Blocks of queries with an explicit mask: the kernels' own causal mask is aligned to
    # the first key, not the last. Each KV head's queries go in as one sequence
    # [1, kv_heads, size * group, d], so no kernel repeats K/V for its query heads.
    for first in range(0, row.q_len, row.block):
        last = min(first + row.block, row.q_len)
        size, key_end = last - first, prefix + last
        # A window hides the keys before the block's first query's window from all of it.
        key_start = max(0, prefix + first - window + 1) if windowed else 0
        tokens = slice(row.q_start + first, row.q_start + last)
        block_q = row_q[first:last].view(size, kv_heads, group, head_dim).transpose(0, 1)
        block_q = block_q.reshape(1, kv_heads, size * group, head_dim)
        if windowed:  # key j is seen by the query at position p where p - window < j <= p
            query_pos = torch.arange(prefix + first, prefix + last, device=q.device)
            keys = torch.arange(key_start, key_end, device=q.device)
            gap = query_pos.unsqueeze(1) - keys.unsqueeze(0)
            mask = (gap >= 0) & (gap < window)
        else:  # keys before prefix + first are visible to the whole block; the rest a triangle
            mask = shape.visible.new_ones(size, key_end)
            mask[:, prefix + first :] = shape.visible[:size, :size]
        mask = mask.repeat_interleave(group, dim=0)
        block_k, block_v = k[:, :, key_start:key_end], v[:, :, key_start:key_end]
        if softcap is None:
            attended = F.scaled_dot_product_attention(
                block_q, block_k, block_v, attn_mask=mask, scale=scale
            )
        else:  # as transformers' eager attention: scale, cap, mask, a float32 softmax
            scores = soft_cap(torch.matmul(block_q, block_k.transpose(-1, -2)).mul_(scale), softcap)
            scores.masked_fill_(~mask, float("-inf"))
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(block_v.dtype)
            attended = torch.matmul(probs, block_v)
        attended = attended.view(kv_heads, size, group, head_dim).transpose(0, 1)
        out[tokens].view(size, kv_heads, group, head_dim).copy_(attended)
