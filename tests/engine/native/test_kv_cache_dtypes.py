"""The native kernels on a KV cache of each narrower --kv-cache-dtype: the RoPE + K/V store
rounds bit for bit as KVPool.write (torch's conversion) does, the attention kernels read every
element as its exact float32 value, and their attention equals the torch backend's on the same
cache."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers.attention_reference import (
    PrefillRow,
    attend_prefill_row,
    scattered_batch,
    scattered_prefill_row,
)

from baton.engine.attention.metadata import build_attention_metadata
from baton.engine.attention.torch_backend import TorchPagedAttention
from baton.engine.kv.pool import KVPool
from baton.engine.models.layers import RotaryEmbedding, apply_rope
from baton.engine.native.library import NativeKernels

COMPACT = [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2]
_BITS = {1: torch.uint8, 2: torch.int16}


def _finite_values(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of `dtype`, ascending, as float32."""
    codes = torch.arange(2 ** (8 * dtype.itemsize), dtype=torch.int32).to(_BITS[dtype.itemsize])
    values = codes.view(dtype).float()
    return values[values.isfinite()].unique()


def _store_cases(dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """Floats to round into `dtype`: every tie between two neighbours (subnormals included) and
    the floats either side of it, random bit patterns (huge, tiny, NaN), float32's subnormals,
    ±0, ±inf, and the edges of e4m3fn's saturation and of float16's and e5m2's infinity."""
    values = _finite_values(dtype).double()
    ties = ((values[1:] + values[:-1]) / 2).float()
    beside = torch.cat([ties.nextafter(ties.new_tensor(-torch.inf)), ties.nextafter(ties * 2)])
    random_bits = torch.randint(-(2**31), 2**31, (20000,), generator=generator, dtype=torch.int64)
    edges = [0.0, 1e-45, 1e-40, 1.17e-38, 447.9, 448, 460, 464, 465, 480, 57344, 61439, 61440,
             65504, 65519, 65520, 1e30, 3.4e38, torch.inf, torch.nan]  # fmt: skip
    cases = torch.cat([ties, beside, random_bits.to(torch.int32).view(torch.float32)])
    return torch.cat([cases, torch.tensor(edges), -torch.tensor(edges)])


@pytest.mark.parametrize("dtype", COMPACT, ids=str)
def test_the_native_store_rounds_as_torch_bit_for_bit(
    native: NativeKernels, dtype: torch.dtype
) -> None:
    """V is stored as it comes (every case above); K after RoPE, against apply_rope then
    KVPool.write."""
    generator = torch.Generator().manual_seed(dtype.itemsize)
    kv_heads, head_dim, q_heads = 2, 64, 4
    values = _store_cases(dtype, generator)
    tokens = -(-values.numel() // (kv_heads * head_dim))
    v = torch.cat([values, torch.zeros(tokens * kv_heads * head_dim - values.numel())])
    v = v.view(tokens, kv_heads, head_dim)
    qk = torch.randn(tokens, q_heads + kv_heads, head_dim, generator=generator) * 100
    positions = torch.randint(0, 512, (tokens,), generator=generator)
    slots = torch.randperm(2 * tokens, generator=generator)[:tokens]
    rotary = RotaryEmbedding(head_dim, 512, 10000.0, None, torch.float32, "cpu")
    angles = rotary.angles(positions)
    expected = KVPool(1, tokens, 2, kv_heads, head_dim, dtype, "cpu")
    rotated = apply_rope(qk, angles.cos, angles.sin)
    expected.write(0, rotated[:, q_heads:], v, slots)
    pool = KVPool(1, tokens, 2, kv_heads, head_dim, dtype, "cpu")
    native.rope_and_store(
        qk, v, rotary.cos, rotary.sin, positions, slots, pool.k_cache(0), pool.v_cache(0)
    )
    bits = _BITS[dtype.itemsize]
    assert torch.equal(qk, rotated)
    assert torch.equal(pool.k_cache(0).view(bits), expected.k_cache(0).view(bits))
    assert torch.equal(pool.v_cache(0).view(bits), expected.v_cache(0).view(bits))


def _cache_read_by(row: PrefillRow, dtype: torch.dtype, limit: float, seed: int) -> torch.Tensor:
    """A cache shaped as `row`'s whose rows that the row reads hold `dtype`'s finite values of at
    most `limit` (each of a float8 at least once), zeros elsewhere."""
    values = _finite_values(dtype)
    values = values[values.abs() <= limit]
    head_dim = row.k_cache.shape[-1]
    read = row.kv_rows.numel() * head_dim
    generator = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, values.numel(), (read,), generator=generator)
    first = min(values.numel(), read)
    picks[:first] = torch.randperm(values.numel(), generator=generator)[:first]
    cache = torch.zeros(row.k_cache.shape)
    cache.view(-1, head_dim)[row.kv_rows] = values[picks].view(-1, head_dim)
    return cache.to(dtype)


@pytest.mark.parametrize("on_amx", [False, True], ids=["f32", "amx"])
@pytest.mark.parametrize("dtype", COMPACT, ids=str)
def test_the_kernels_read_each_element_as_its_float32_value(
    native: NativeKernels, dtype: torch.dtype, on_amx: bool
) -> None:
    """Attention over a compact cache is bit for bit attention over a float32 cache of its
    values: the widening is exact (float8 subnormals included) and the arithmetic the same.
    Keys of moderate size keep the softmax spread; zero queries weigh every value alike."""
    if on_amx and not native.amx:
        pytest.skip("needs a CPU with AMX-BF16 (and a kernel that lends its tiles)")
    kv_heads, head_dim = 2, 64
    row = scattered_prefill_row(40, 90, 6, kv_heads, head_dim)
    kv_len = row.kv_rows.numel() // kv_heads
    k_cache = _cache_read_by(row, dtype, 64, 1)
    v_cache = _cache_read_by(row, dtype, 2**16, 2)
    # Decode rows read the prefill row's keys as pages of one token: head 0's rows are slots.
    meta = build_attention_metadata([kv_len - 1], [1], [(row.kv_rows[:kv_len] // 2).tolist()], 1)
    for q in (row.q * 0.05, torch.zeros_like(row.q)):
        outputs = []
        for k, v in ((k_cache, v_cache), (k_cache.float(), v_cache.float())):
            cached = dataclasses.replace(row, q=q, k_cache=k, v_cache=v)
            outputs.append(attend_prefill_row(native, cached, on_amx))
            if not on_amx:
                outputs.append(native.decode_attention(
                    q[-1:], torch.tensor([0], dtype=torch.int32), k.unsqueeze(1), v.unsqueeze(1),
                    meta.kv_indptr, meta.kv_indices, torch.tensor([kv_len], dtype=torch.int32),
                    head_dim**-0.5,
                ))  # fmt: skip
        half = len(outputs) // 2
        for compact, widened in zip(outputs[:half], outputs[half:]):
            assert compact.isfinite().all() and torch.equal(compact, widened)


@pytest.mark.parametrize("head_dim", [8, 64])
@pytest.mark.parametrize("dtype", COMPACT, ids=str)
def test_native_attention_on_a_compact_cache_equals_the_torch_backends(
    native: NativeKernels, dtype: torch.dtype, head_dim: int
) -> None:
    """Decode rows (several parts of a long row), prefill rows with and without a cached
    prefix, over scattered pages of one cache: the native kernels (prefill's at head_dim 64)
    against the torch backend's gathers widened to float32."""
    generator = torch.Generator().manual_seed(head_dim)
    rows = [(300, 1), (3, 1), (0, 37), (20, 13)]
    source, meta, _, _ = scattered_batch(rows, 16, 2, head_dim, torch.float32, generator)
    pool = KVPool(1, source.num_pages, 16, 2, head_dim, dtype, "cpu")
    every_slot = torch.arange(source.num_pages * 16)
    keys, values = (cache.view(-1, 2, head_dim) for cache in (source.k_cache(0), source.v_cache(0)))
    pool.write(0, keys * 4, values, every_slot)
    q = torch.randn(sum(n for _, n in rows), 6, head_dim, generator=generator)
    scale = head_dim**-0.5
    caches = (pool.k_cache(0), pool.v_cache(0))
    native_out = TorchPagedAttention(6, 2, native=native).forward(q, *caches, meta, scale)
    torch_out = TorchPagedAttention(6, 2).forward(q, *caches, meta, scale)
    torch.testing.assert_close(native_out, torch_out, rtol=1e-5, atol=2e-6)
