"""Paged attention in plain torch: the CPU backend (it runs unchanged on CUDA tensors too).

All index work happens once per batch in `plan`; `forward` (once per layer) is gathers and
attention kernels. K/V rows are gathered head-major straight out of the cache viewed as
[slots * kv_heads, head_dim], so the gathered tensor is already [kv_heads, keys, head_dim] per
sequence and query heads are grouped over it without repeating K/V (a repeat costs more than the
attention itself on CPU). Prefill rows run torch's fused attention: on CPU a row without a cached
prefix is one causal call to its flash kernel (on Zen 3 1.6x a matmul-softmax-matmul, at 128 and
at 1024 queries); other rows go in masked blocks of queries (torch_prefill.py). Rows gathered from
a narrower cache (`--kv-cache-dtype`) are widened to the queries' dtype; the native kernels widen
as they load. Every path computes a layer's window and soft cap where it has them (the native
kernels too) but the AMX prefill kernel, whose rows then attend in torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from baton.engine.attention.base import AttentionBackend, soft_cap
from baton.engine.attention.metadata import AttentionMetadata
from baton.engine.attention.torch_prefill import PrefillRow, PrefillShape, attend_prefill_row
from baton.engine.native.library import NativeKernels

# Score elements (query heads x queries x keys) of one masked block of a prefill row: a kernel
# without a flash path (CUDA's for float32 or with a mask) holds them all, so blocks bound its
# memory for long prompts. Blocks keep >= _MIN_QUERY_BLOCK queries.
_SCORE_BLOCK_ELEMENTS = 1 << 21
_MIN_QUERY_BLOCK = 32


@dataclass(frozen=True)
class _DecodePlan:
    """Decode rows (one query each), attended together over K/V padded to the longest row."""

    tokens: slice | torch.Tensor  # which rows of q/out belong to these sequences
    kv_rows: torch.Tensor  # [batch * kv_heads * max_kv_len] rows of the cache viewed [-1, head_dim]
    max_kv_len: int
    bias: torch.Tensor  # [batch * kv_heads, 1, max_kv_len] float32: 0, or -inf on padding
    early: torch.Tensor  # [batch, max_kv_len] int64: how far each key is behind the row's last
    # `bias` with -inf too on the keys each window hides, by window, made as layers ask.
    window_bias: dict[int, torch.Tensor] = field(default_factory=dict)

    def bias_for(self, window: int | None, kv_heads: int) -> torch.Tensor:
        """The bias of a layer with `window` (None: full attention)."""
        if window is None:
            return self.bias
        if window not in self.window_bias:
            hidden = (self.early >= window).repeat_interleave(kv_heads, dim=0).unsqueeze(1)
            self.window_bias[window] = self.bias.masked_fill(hidden, float("-inf"))
        return self.window_bias[window]


@dataclass(frozen=True)
class _NativeDecodePlan:
    """Decode rows for the native kernel, which reads each row's pages in place."""

    tokens: slice | torch.Tensor  # which rows of q/out belong to these sequences
    rows: torch.Tensor  # [decode rows] int32: each one's row in the batch metadata
    kv_lens: torch.Tensor  # [batch] int32


class TorchPagedAttention(AttentionBackend):
    """Grouped-query attention over the paged cache for ragged prefill + decode batches."""

    def __init__(
        self,
        num_q_heads: int,
        num_kv_heads: int,
        query_block: int = 512,
        native: NativeKernels | None = None,
        prefill_dtype: torch.dtype | None = None,
        amx_prefill: bool = False,
    ) -> None:
        """`native`: decode rows run the native kernel (float32 CPU models, head_dim a
        multiple of 8: the caller checks; a cache of any --kv-cache-dtype), and so do prefill
        rows in float32 (native/attention/prefill_attention.c, at head_dim a multiple of 16 up
        to 256: 2-3x torch's flash kernel with its gathers and copies for SmolLM2's 128-token
        prompts, level at 2048).
        Prefill rows run in torch in `prefill_dtype` where given (the float32 plan with bf16
        GEMMs: ComputePlan.gemm_dtype, whose prefill stays in the bf16 hardware, attention
        included).
        `amx_prefill`: with `native` and a bf16 `prefill_dtype`, on a CPU whose tiles the plan
        uses, prefill rows attend on AMX instead (native/attention/amx_attention.c: 2.4x torch's
        flash kernel, at head_dim a multiple of 32 up to 256)."""
        if num_q_heads % num_kv_heads:
            raise ValueError(f"{num_q_heads} query heads do not group over {num_kv_heads} KV heads")
        self.num_q_heads = num_q_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_q_heads // num_kv_heads
        self.query_block = query_block
        self.native = native
        self.prefill_dtype = prefill_dtype
        self.amx_prefill = amx_prefill and native is not None and prefill_dtype == torch.bfloat16
        self._meta: AttentionMetadata | None = None
        self._decode: _DecodePlan | _NativeDecodePlan | None = None
        self._prefill: list[PrefillRow] = []
        # True on and below the diagonal: the keys a block's queries see past the prefix.
        self._visible = torch.ones(0, 0, dtype=torch.bool)

    def plan(self, meta: AttentionMetadata) -> None:
        """Precompute the gather indices and masks that every layer's `forward` reuses."""
        device = meta.kv_indices.device
        q_starts = [0]
        for n in meta.q_lens:
            q_starts.append(q_starts[-1] + n)
        decode_rows = [i for i, n in enumerate(meta.q_lens) if n == 1]
        self._decode = None
        if decode_rows and self.native is not None:
            self._decode = _NativeDecodePlan(
                _token_selector([q_starts[i] for i in decode_rows], device),
                torch.tensor(decode_rows, dtype=torch.int32, device=device),
                torch.tensor(meta.kv_lens, dtype=torch.int32, device=device),
            )
        elif decode_rows:
            self._decode = self._plan_decode(meta, decode_rows, q_starts)
        self._prefill = []
        for i, n in enumerate(meta.q_lens):
            if n == 1:
                continue
            kv_len = meta.kv_lens[i]
            positions = torch.arange(kv_len, device=device).unsqueeze(0)
            kv_rows = self._kv_rows(meta, torch.tensor([i], device=device), positions)
            fitting = _SCORE_BLOCK_ELEMENTS // (self.num_q_heads * kv_len)
            block = min(self.query_block, max(_MIN_QUERY_BLOCK, fitting))
            self._prefill.append(PrefillRow(q_starts[i], n, kv_len, kv_rows, block))
        largest_block = max((row.block for row in self._prefill), default=0)
        if self._visible.shape[0] < largest_block or self._visible.device != device:
            size = max(largest_block, self._visible.shape[0])
            self._visible = torch.ones(size, size, dtype=torch.bool, device=device).tril_()
        self._meta = meta

    def _plan_decode(
        self, meta: AttentionMetadata, rows: list[int], q_starts: list[int]
    ) -> _DecodePlan:
        device = meta.kv_indices.device
        kv_lens_list = [meta.kv_lens[i] for i in rows]
        max_kv_len = max(kv_lens_list)
        kv_lens = torch.tensor(kv_lens_list, device=device).unsqueeze(1)
        positions = torch.arange(max_kv_len, device=device).unsqueeze(0)
        # Padding re-reads the row's last key (always written, so never NaN); the bias hides it.
        clamped = torch.minimum(positions, kv_lens - 1)
        kv_rows = self._kv_rows(meta, torch.tensor(rows, device=device), clamped)
        padding = (positions >= kv_lens).repeat_interleave(self.num_kv_heads, dim=0).unsqueeze(1)
        bias = torch.zeros(padding.shape, device=device).masked_fill_(padding, float("-inf"))
        tokens = _token_selector([q_starts[i] for i in rows], device)
        return _DecodePlan(tokens, kv_rows, max_kv_len, bias, kv_lens - 1 - positions)

    def _kv_rows(
        self, meta: AttentionMetadata, rows: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """Flat head-major cache rows [len(rows) * kv_heads * positions] for `positions` [R, L]."""
        page_size = meta.page_size
        page_slots = meta.kv_indptr[rows].long().unsqueeze(1) + positions // page_size
        slots = meta.kv_indices[page_slots].long() * page_size + positions % page_size
        heads = torch.arange(self.num_kv_heads, device=slots.device).view(1, -1, 1)
        return (slots.unsqueeze(1) * self.num_kv_heads + heads).reshape(-1)

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
        """Attention of q [tokens, q_heads, head_dim] over the cache; see AttentionBackend."""
        if meta is not self._meta:
            self.plan(meta)
        head_dim = q.shape[-1]
        k_rows = k_cache.view(-1, head_dim)
        v_rows = v_cache.view(-1, head_dim)
        q_cache = q.to(_attention_dtype(q.dtype, k_cache.dtype))
        decode, limits = self._decode, (window, softcap)
        if decode is not None and not self._prefill and isinstance(decode.tokens, slice):
            return self._attend_decode(q_cache, k_cache, v_cache, decode, scale, *limits).to(
                q.dtype
            )
        out = torch.empty_like(q_cache)
        if decode is not None:
            if isinstance(decode.tokens, slice):
                out[decode.tokens] = self._attend_decode(
                    q_cache[decode.tokens], k_cache, v_cache, decode, scale, *limits
                )
            else:
                decode_q = q_cache.index_select(0, decode.tokens)
                decode_out = self._attend_decode(decode_q, k_cache, v_cache, decode, scale, *limits)
                out.index_copy_(0, decode.tokens, decode_out)
        native = self.native is not None and head_dim <= 256
        if self.amx_prefill:
            native = native and head_dim % 32 == 0
        else:  # float32, unless the plan's prefill computes in bf16 (then torch's kernel)
            native = native and head_dim % 16 == 0 and self.prefill_dtype is None
        shape = PrefillShape(
            self.num_kv_heads, self.group, self.prefill_dtype or q_cache.dtype, self._visible
        )
        for row in self._prefill:
            # The AMX kernel has no window or soft cap: such rows attend in torch.
            restricted = row.windowed(window) or softcap is not None
            if native and not (self.amx_prefill and restricted):
                tokens = slice(row.q_start, row.q_start + row.q_len)
                prefix = row.kv_len - row.q_len
                self.native.prefill_attention(
                    q_cache[tokens],
                    prefix,
                    k_cache,
                    v_cache,
                    row.kv_rows,
                    scale,
                    out[tokens],
                    on_amx=self.amx_prefill,
                    window=window if row.windowed(window) else None,
                    softcap=softcap,
                )
            else:
                attend_prefill_row(q_cache, k_rows, v_rows, row, scale, out, shape, *limits)
        return out.to(q.dtype)

    def _attend_decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: _DecodePlan | _NativeDecodePlan,
        scale: float,
        window: int | None,
        softcap: float | None,
    ) -> torch.Tensor:
        if isinstance(plan, _NativeDecodePlan):
            meta = self._meta
            pages = (meta.kv_indptr, meta.kv_indices, plan.kv_lens)
            return self.native.decode_attention(
                q, plan.rows, k_cache, v_cache, *pages, scale, window, softcap
            )
        batch, head_dim = q.shape[0], q.shape[-1]
        groups = batch * self.num_kv_heads  # one [group, head_dim] query matrix per (row, KV head)
        kv_shape = (groups, plan.max_kv_len, head_dim)
        k = k_cache.view(-1, head_dim).index_select(0, plan.kv_rows).to(q.dtype).view(kv_shape)
        v = v_cache.view(-1, head_dim).index_select(0, plan.kv_rows).to(q.dtype).view(kv_shape)
        grouped_q = q.reshape(groups, self.group, head_dim)
        bias = plan.bias_for(window, self.num_kv_heads).to(q.dtype)
        if softcap is None:
            # baddbmm folds scale and bias into the GEMM: one rounding, no extra passes.
            scores = torch.baddbmm(bias, grouped_q, k.transpose(1, 2), alpha=scale)
        else:  # capped after scaling, before the mask (transformers' order)
            scores = torch.bmm(grouped_q, k.transpose(1, 2)).mul_(scale)
            scores = soft_cap(scores, softcap).add_(bias)
        # Softmax accumulates in float32 even for bf16/fp16 inputs (CPU and CUDA kernels alike).
        probs = torch.softmax(scores, dim=-1)
        return torch.bmm(probs, v).view(batch, self.num_q_heads, head_dim)


def _attention_dtype(q_dtype: torch.dtype, cache_dtype: torch.dtype) -> torch.dtype:
    """The wider of the queries' and the cache's dtype (a float32 cache under a bf16 model stays
    float32), but never float8, which torch cannot multiply (its values are exact in q's)."""
    if cache_dtype.itemsize == 1:
        return q_dtype
    return torch.promote_types(q_dtype, cache_dtype)


def _token_selector(token_ids: list[int], device: torch.device) -> slice | torch.Tensor:
    """The rows of q holding these tokens: a slice where they are consecutive (a view, no copy)."""
    first = token_ids[0]
    if token_ids == list(range(first, first + len(token_ids))):
        return slice(first, first + len(token_ids))
    return torch.tensor(token_ids, device=device)
