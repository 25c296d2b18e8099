"""The native attention kernels as torch-facing functions: RoPE with the K/V store, a prefill
row's attention and decode attention, reading the paged KV cache in place in any of its dtypes
(attention/*.c; RoPE and the store: layer/norm_and_rope.c)."""

from __future__ import annotations

import ctypes

import torch

from baton.engine.native.linear_kernels import I64, PTR, declare

# The KV cache's element types as the attention kernels number them (attention/kv_cache.h's
# KvType): they widen each to float32 as they read it, and the K/V store rounds into it.
KV_ELEMENT_TYPES = {
    torch.float32: 0,
    torch.bfloat16: 1,
    torch.float16: 2,
    torch.float8_e4m3fn: 3,
    torch.float8_e5m2: 4,
}


def kv_element_type(cache: torch.Tensor) -> int:
    """The kernels' number for `cache`'s dtype; ValueError for one they do not read."""
    if cache.dtype not in KV_ELEMENT_TYPES:
        raise ValueError(f"the native kernels read no KV cache of {cache.dtype}")
    return KV_ELEMENT_TYPES[cache.dtype]


class AttentionKernels:
    """The loaded library's attention kernels (NativeKernels has them with the rest)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._rope = declare(
            library.baton_rope_and_store, None, [PTR, I64, PTR, I64, *[I64] * 4, *[PTR] * 6, I64]
        )
        # A prefill row's attention: bf16 on AMX tiles (amx_attention.c), or float32 with
        # AVX2 FMAs (prefill_attention.c), which also takes a window and a soft cap.
        prefill_arguments = [PTR, *[I64] * 3, *[PTR] * 3, *[I64] * 3, ctypes.c_float, PTR, I64, I64]
        self._prefill_attention = {
            True: declare(library.baton_prefill_attention, ctypes.c_int, prefill_arguments),
            False: declare(
                library.baton_prefill_attention_f32,
                ctypes.c_int,
                [*prefill_arguments, I64, ctypes.c_float],
            ),
        }
        self._attention = declare(
            library.baton_decode_attention,
            ctypes.c_int,
            [PTR, I64, PTR, I64, *[PTR] * 5, *[I64] * 4, *[ctypes.c_float] * 2, I64, I64, PTR],
        )

    def rope_and_store(
        self,
        qk: torch.Tensor,
        v: torch.Tensor,
        cos_table: torch.Tensor,
        sin_table: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> None:
        """Rotate qk ([tokens, q_heads + kv_heads, head_dim], float32, rows may be strided;
        each head contiguous) in place by `positions` (int64) and store its k heads and v
        ([tokens, kv_heads, head_dim]) at `slots` (int64) of the caches, rounded into their
        dtype (KV_ELEMENT_TYPES) bit for bit as KVPool.write rounds them."""
        tokens, heads, head_dim = qk.shape
        kv_heads = v.shape[1]
        self._rope(
            qk.data_ptr(),
            qk.stride(0),
            v.data_ptr(),
            v.stride(0),
            tokens,
            heads - kv_heads,
            kv_heads,
            head_dim,
            cos_table.data_ptr(),
            sin_table.data_ptr(),
            positions.data_ptr(),
            slots.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            kv_element_type(k_cache),
        )

    def prefill_attention(
        self,
        q: torch.Tensor,
        prefix: int,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        kv_rows: torch.Tensor,
        scale: float,
        out: torch.Tensor,
        on_amx: bool,
        window: int | None = None,
        softcap: float | None = None,
    ) -> None:
        """Causal attention of one prefill row, into `out`: in bf16 on AMX tiles where `on_amx`
        (amx_attention.c; head_dim a multiple of 32), else in float32 (prefill_attention.c;
        head_dim a multiple of 16), up to 256 values a head. q and out float32 [q_len, q_heads,
        head_dim] (rows may be strided, each head contiguous), the queries after `prefix`
        cached keys; kv_rows (int64 [kv_heads * (prefix + q_len)]) each KV head's keys as rows
        of the caches viewed [-1, head_dim], in any dtype of KV_ELEMENT_TYPES. `window` and
        `softcap` as AttentionBackend.forward's, in float32 only (ValueError on AMX)."""
        q_len, q_heads, head_dim = q.shape
        for tensor in (q, out):
            if tensor.stride(2) != 1 or tensor.stride(1) != head_dim:
                raise ValueError("each query head's values must be contiguous")
        limits = () if on_amx else (window or 0, softcap or 0.0)
        if on_amx and (window is not None or softcap is not None):
            raise ValueError("the AMX prefill attention has no window or soft cap")
        status = self._prefill_attention[on_amx](
            q.data_ptr(),
            q.stride(0),
            q_len,
            prefix,
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            kv_rows.data_ptr(),
            q_heads,
            k_cache.shape[-2],
            head_dim,
            scale,
            out.data_ptr(),
            out.stride(0),
            kv_element_type(k_cache),
            *limits,
        )
        if status == -2:
            raise MemoryError("the prefill attention could not allocate its buffers")
        if status:
            raise ValueError(
                f"no native prefill attention for {q_heads} heads of {head_dim} values"
            )

    def decode_attention(
        self,
        q: torch.Tensor,
        rows: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        kv_lens: torch.Tensor,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """One float32 query per row of `rows` (int32 batch rows) over its pages of the caches
        ([pages, page_size, kv_heads, head_dim], in any dtype of KV_ELEMENT_TYPES); q: [n,
        q_heads, head_dim], rows may be strided; `window` and `softcap` as
        AttentionBackend.forward's. Returns [n, q_heads, head_dim]."""
        n, q_heads, head_dim = q.shape
        if q.stride(2) != 1 or q.stride(1) != head_dim:
            q = q.contiguous()  # the kernel steps over rows by stride, within them densely
        _, page_size, kv_heads, _ = k_cache.shape
        out = torch.empty(n, q_heads, head_dim, dtype=torch.float32)
        status = self._attention(
            q.data_ptr(),
            q.stride(0),
            rows.data_ptr(),
            n,
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            kv_indptr.data_ptr(),
            kv_indices.data_ptr(),
            kv_lens.data_ptr(),
            q_heads,
            kv_heads,
            head_dim,
            page_size,
            scale,
            softcap or 0.0,
            window or 0,
            kv_element_type(k_cache),
            out.data_ptr(),
        )
        if status:
            raise MemoryError("decode attention could not allocate its scores")
        return out
