"""The native RoPE + K/V store, decode attention and float32 activation against the torch path
they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from baton.engine.attention.metadata import build_attention_metadata
from baton.engine.attention.torch_backend import TorchPagedAttention
from baton.engine.cpu.capabilities import detect_cpu_capabilities
from baton.engine.kv.pool import KVPool
from baton.engine.models.layers import RotaryEmbedding, apply_rope
from baton.engine.models.mlp import GatedMLP
from baton.engine.native.library import NativeKernels, load_native_kernels
from baton.hardware import isa_rank


@pytest.mark.parametrize("tokens", [7, 70])  # one task; a prefill's, over the threads
@pytest.mark.parametrize(("q_heads", "kv_heads", "head_dim"), [(4, 2, 24), (9, 3, 64)])
def test_rope_and_store_equals_apply_rope_and_the_pool_write_bit_for_bit(
    native: NativeKernels, q_heads: int, kv_heads: int, head_dim: int, tokens: int
) -> None:
    """q and k rotated in place inside the fused qkv buffer (strided rows), as the model
    calls it; k and v land at their slots. Bit-identical: the KV cache holds exactly what the
    torch path would have written."""
    generator = torch.Generator().manual_seed(head_dim)
    heads = q_heads + 2 * kv_heads
    rotary = RotaryEmbedding(head_dim, 512, 10000.0, None, torch.float32, "cpu")
    qkv = torch.randn(tokens, heads * head_dim, generator=generator)
    positions = torch.tensor([0, 1, 2, 100, 101, 257, 511] * 10)[:tokens]
    slots = torch.randperm(200, generator=generator)[:tokens]
    angles = rotary.angles(positions)
    qk_width = (q_heads + kv_heads) * head_dim
    expected_qk = apply_rope(qkv[:, :qk_width].view(tokens, -1, head_dim), angles.cos, angles.sin)
    v = qkv[:, qk_width:].view(tokens, kv_heads, head_dim)
    expected_pool = KVPool(1, 50, 4, kv_heads, head_dim, torch.float32, "cpu")
    expected_pool.write(0, expected_qk[:, q_heads:], v, slots)

    pool = KVPool(1, 50, 4, kv_heads, head_dim, torch.float32, "cpu")
    qk = qkv[:, :qk_width].view(tokens, -1, head_dim)
    native.rope_and_store(
        qk, v, rotary.cos, rotary.sin, positions, slots, pool.k_cache(0), pool.v_cache(0)
    )
    assert torch.equal(qk, expected_qk)
    assert torch.equal(pool.k_cache(0), expected_pool.k_cache(0))
    assert torch.equal(pool.v_cache(0), expected_pool.v_cache(0))


def _native_against_reference_attention(
    native: NativeKernels,
    kv_lens: list[int],
    page_size: int,
    seed: int,
    head_dim: int = 16,
    window: int | None = None,
    softcap: float | None = None,
) -> None:
    """One decode query per row over its own shuffled pages; scores large enough that the max
    subtraction matters; over a `window` and soft-capped where given."""
    generator = torch.Generator().manual_seed(seed)
    pages_per_row = [-(-kv_len // page_size) for kv_len in kv_lens]
    pool = KVPool(1, sum(pages_per_row) + 1, page_size, 2, head_dim, torch.float32, "cpu")
    pool.k_cache(0).normal_(generator=generator).mul_(4)
    pool.v_cache(0).normal_(generator=generator)
    order = torch.randperm(sum(pages_per_row), generator=generator).tolist()
    ends = torch.tensor(pages_per_row).cumsum(0).tolist()
    tables = [order[end - count : end] for end, count in zip(ends, pages_per_row)]
    meta = build_attention_metadata(
        [kv_len - 1 for kv_len in kv_lens], [1] * len(kv_lens), tables, page_size
    )
    q = torch.randn(len(kv_lens), 6, head_dim, generator=generator)
    out = TorchPagedAttention(6, 2, native=native).forward(
        q, pool.k_cache(0), pool.v_cache(0), meta, 0.25, window, softcap
    )
    # Against the same attention in float64: float32's own rounding (torch's float32 path
    # differs from float64 by up to ~1e-6 here, summing in another order than the kernel).
    expected = TorchPagedAttention(6, 2).forward(
        q.double(), pool.k_cache(0).double(), pool.v_cache(0).double(), meta, 0.25, window, softcap
    )
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("kv_len", [1, 7, 8, 9, 16, 33, 300])
def test_decode_attention_matches_torch_at_every_softmax_length(
    native: NativeKernels, kv_len: int
) -> None:
    """Lengths around the kernel's 8-wide exp loop and its scalar tail, one key, many pages."""
    _native_against_reference_attention(native, [kv_len] * 3, 4, kv_len)


@pytest.mark.parametrize("head_dim", [8, 24, 56, 64, 72, 128])
def test_decode_attention_matches_torch_at_every_head_width(
    native: NativeKernels, head_dim: int
) -> None:
    """Each width the kernel sums V in (slices of 64, 32, 16 and 8 values) and their mixes."""
    _native_against_reference_attention(native, [40, 3], 16, head_dim, head_dim)


@pytest.mark.parametrize("window", [1, 5, 8, 40, 500])
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_decode_attention_over_a_window_and_soft_capped_matches_torch(
    native: NativeKernels, window: int, softcap: float | None
) -> None:
    """A window of one key (the query's own), windows starting inside a page, past a row's
    length, split across threads; soft-capped scores (capped well below their spread)."""
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        _native_against_reference_attention(native, [40, 3, 300], 4, window, 16, window, softcap)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [2, 3, 8])
@pytest.mark.parametrize("kv_lens", [[1], [31], [64], [65], [1000], [300, 5], [70, 64, 2000]])
def test_decode_attention_split_across_threads_matches_torch(
    native: NativeKernels, threads: int, kv_lens: list[int]
) -> None:
    """Fewer rows than threads: each row's tokens are split into parts (page boundaries falling
    inside parts, parts too short to use, uneven shares) whose softmaxes are merged."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # the kernel splits for the calling thread's team size
    try:
        for page_size in (1, 16):
            _native_against_reference_attention(native, kv_lens, page_size, sum(kv_lens) + threads)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dim", [64, 576, 67])
@pytest.mark.parametrize("rows", [5, 100])  # one task; a prefill's, over the threads
def test_rms_norm_matches_torch(native: NativeKernels, dim: int, rows: int) -> None:
    """Widths with and without a tail past the last 8 floats."""
    generator = torch.Generator().manual_seed(dim)
    x = torch.randn(rows, dim, generator=generator) * 3
    weight = torch.randn(dim, generator=generator)
    expected = torch.nn.functional.rms_norm(x, (dim,), weight, 1e-6)
    torch.testing.assert_close(native.rms_norm(x, weight, 1e-6), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("inter", [96, 1030])  # a vector tail; slices of 1024 and a tail
def test_the_float32_activation_matches_torch_and_serves_the_mlp(
    native: NativeKernels, inter: int
) -> None:
    """silu(gate) * up over float32 rows (the native step's, and a float32 prefill's MLP): torch's
    values within float32 rounding (its exp is within 2 ulp of torch's)."""
    gate_up = torch.randn(37, 2 * inter, generator=torch.Generator().manual_seed(inter)) * 4
    gate, up = gate_up.split(inter, dim=-1)
    torch.testing.assert_close(native.silu_mul(gate_up), F.silu(gate) * up, rtol=2e-6, atol=1e-6)
    mlp = GatedMLP(64, inter, False, torch.float32, "cpu")
    with torch.no_grad():
        for linear in (mlp.gate_up_proj, mlp.down_proj):
            linear.weight.normal_(std=0.1)
    rows = torch.randn(300, 64)
    torch_path = mlp(rows)
    calls: list[int] = []

    class CountingKernels:  # the native activation's calls, counted
        def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
            calls.append(gate_up.shape[0])
            return native.silu_mul(gate_up)

    mlp.native = CountingKernels()
    torch.testing.assert_close(mlp(rows), torch_path, rtol=1e-5, atol=1e-5)
    assert calls == [300]


@pytest.mark.parametrize("inter", [96, 1030, 1037])  # tails past 16 and past 8 floats
def test_the_activation_is_the_same_at_both_vector_widths(inter: int) -> None:
    """AVX-512's 16 floats a vector compute each value bit for bit as AVX2's 8, in float32 and
    from bf16 rows."""
    if isa_rank(detect_cpu_capabilities().isa) < isa_rank("avx512"):
        pytest.skip("this CPU (or its ISA cap) has no AVX-512")
    wide, narrow = load_native_kernels(avx512=True), load_native_kernels(avx512=False)
    gate_up = torch.randn(9, 2 * inter, generator=torch.Generator().manual_seed(inter)) * 6
    assert torch.equal(wide.silu_mul(gate_up), narrow.silu_mul(gate_up))
    gate_up = gate_up.to(torch.bfloat16)
    assert torch.equal(wide.silu_mul_bf16(gate_up), narrow.silu_mul_bf16(gate_up))
