"""TorchPagedAttention against a dense reference; the metadata builder; backend selection."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from helpers.attention_reference import dense_reference, scattered_batch

from baton.engine.attention.metadata import build_attention_metadata
from baton.engine.attention.select import make_attention_backend
from baton.engine.attention.torch_backend import TorchPagedAttention
from baton.engine.cpu.capabilities import detect_cpu_capabilities
from baton.engine.native.library import NativeKernels, load_native_kernels
from baton.hardware import isa_rank

# (cached prefix, new tokens) per row: prefill chunks with and without a prefix, decode rows
# interleaved with them (so decode queries are not contiguous), a row whose kv length is a multiple
# of 16, and a decode row with a single key.
MIXED_ROWS = [(0, 13), (5, 1), (37, 1), (20, 9), (15, 1), (0, 1), (31, 17), (2, 2)]
DECODE_ROWS = [(40, 1), (3, 1), (15, 1), (0, 1), (63, 1)]


@pytest.fixture(params=["torch", "native"])
def decode_kernels(request: pytest.FixtureRequest) -> NativeKernels | None:
    """Decode rows in torch, or in the native kernel (float32 CPU caches, AVX2)."""
    if request.param == "torch":
        return None
    if isa_rank(detect_cpu_capabilities().isa) < isa_rank("avx2"):
        pytest.skip("the native kernels need AVX2")
    return load_native_kernels()


def _run_case(
    rows: list[tuple[int, int]],
    page_size: int,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    query_block: int = 512,
    native: NativeKernels | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1234 + page_size + 7 * q_heads + head_dim)
    pool, meta, keys, values = scattered_batch(
        rows, page_size, kv_heads, head_dim, dtype, generator
    )
    q = torch.randn(meta.num_tokens, q_heads, head_dim, generator=generator).to(dtype)
    scale = 1.0 / math.sqrt(head_dim)
    backend = TorchPagedAttention(q_heads, kv_heads, query_block=query_block, native=native)
    backend.plan(meta)
    out = backend.forward(q, pool.k_cache(0), pool.v_cache(0), meta, scale, window, softcap)
    assert out.shape == q.shape and out.dtype == dtype
    return out.double(), dense_reference(q, meta, keys, values, scale, window, softcap)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("q_heads", "kv_heads"), [(4, 4), (4, 2), (8, 2)])
@pytest.mark.parametrize("head_dim", [64, 24])
@pytest.mark.parametrize("rows", [MIXED_ROWS, DECODE_ROWS], ids=["mixed", "decode"])
def test_matches_dense_reference_float32(
    rows: list[tuple[int, int]],
    page_size: int,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    decode_kernels: NativeKernels | None,
) -> None:
    out, expected = _run_case(
        rows, page_size, q_heads, kv_heads, head_dim, torch.float32, native=decode_kernels
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


# A window of the query's own key alone, one inside a chunk, one past every row; soft caps below
# the scores' spread. Blocks of 8 queries: a window starting inside a block, blocks it skips.
@pytest.mark.parametrize(("window", "softcap"), [(1, None), (6, None), (100, None), (6, 0.5)])
@pytest.mark.parametrize("head_dim", [64, 24])
def test_a_window_and_a_soft_cap_match_the_dense_reference(
    window: int, softcap: float | None, head_dim: int, decode_kernels: NativeKernels | None
) -> None:
    """In torch, or with the native kernels (decode rows, and float32 prefill rows at head_dim
    64), with and without a cached prefix."""
    out, expected = _run_case(
        MIXED_ROWS, 4, 4, 2, head_dim, torch.float32, 8, decode_kernels, window, softcap
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("q_heads", "kv_heads"), [(4, 1), (8, 2)])
def test_matches_dense_reference_bfloat16(page_size: int, q_heads: int, kv_heads: int) -> None:
    out, expected = _run_case(MIXED_ROWS, page_size, q_heads, kv_heads, 64, torch.bfloat16)
    torch.testing.assert_close(out, expected, atol=3e-2, rtol=3e-2)


def test_prefill_rows_attend_in_the_prefill_dtype_and_decode_rows_in_the_caches(
    decode_kernels: NativeKernels | None,
) -> None:
    """The float32 plan with bf16 GEMMs: prefill rows (causal, and past a cached prefix) attend
    in bf16 into the float32 output; decode rows are untouched."""
    generator = torch.Generator().manual_seed(7)
    pool, meta, keys, values = scattered_batch(MIXED_ROWS, 16, 2, 64, torch.float32, generator)
    q = torch.randn(meta.num_tokens, 4, 64, generator=generator)
    outputs = {}
    for prefill_dtype in (None, torch.bfloat16):
        backend = TorchPagedAttention(4, 2, native=decode_kernels, prefill_dtype=prefill_dtype)
        outputs[prefill_dtype] = backend.forward(q, pool.k_cache(0), pool.v_cache(0), meta, 0.125)
    mixed = outputs[torch.bfloat16]
    assert mixed.dtype == torch.float32
    starts = [0, *itertools.accumulate(meta.q_lens)]
    decode = [starts[i] for i, n in enumerate(meta.q_lens) if n == 1]
    prefill = [
        t for i, n in enumerate(meta.q_lens) if n > 1 for t in range(starts[i], starts[i + 1])
    ]
    torch.testing.assert_close(mixed[decode], outputs[None][decode], atol=0, rtol=0)
    assert not torch.equal(mixed[prefill], outputs[None][prefill])
    rounded = [t.bfloat16().float() for t in (q, *keys, *values)]
    n_rows = len(keys)
    expected = dense_reference(
        rounded[0], meta, rounded[1 : 1 + n_rows], rounded[1 + n_rows :], 0.125
    )
    torch.testing.assert_close(mixed[prefill].double(), expected[prefill], atol=2e-2, rtol=2e-2)


def test_long_rows_split_into_query_blocks() -> None:
    """Blocks of 4 queries cut every prefill row after a cached prefix, including mid-way through
    its causal triangle (on CPU a row without one is a single causal call)."""
    rows = [(9, 23), (0, 1), (0, 30), (50, 5)]
    out, expected = _run_case(rows, 4, 6, 2, 32, torch.float32, query_block=4)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_a_long_cached_prefix_shrinks_the_blocks() -> None:
    """Past ~5000 keys a block's scores would exceed the bound at the default block, so the row
    is cut by its length (here into blocks of 68 queries); a two-query row follows a prefix."""
    out, expected = _run_case([(5000, 100), (3, 2)], 16, 6, 2, 32, torch.float32)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "rows", [[(19, 1)] * 4, [(0, 7), (12, 3)]], ids=["equal-decode", "prefill-only"]
)
def test_uniform_batches(rows: list[tuple[int, int]], decode_kernels: NativeKernels | None) -> None:
    out, expected = _run_case(rows, 4, 4, 2, 16, torch.float32, native=decode_kernels)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [MIXED_ROWS, DECODE_ROWS], ids=["mixed", "decode"])
def test_query_sliced_from_fused_qkv(
    rows: list[tuple[int, int]], decode_kernels: NativeKernels | None
) -> None:
    """Models slice q out of a fused QKV projection, so q arrives non-contiguous."""
    generator = torch.Generator().manual_seed(11)
    pool, meta, keys, values = scattered_batch(rows, 16, 2, 32, torch.float32, generator)
    qkv = torch.randn(meta.num_tokens, 8 + 2 * 2, 32, generator=generator)
    q = qkv[:, :8]
    backend = TorchPagedAttention(8, 2, native=decode_kernels)
    out = backend.forward(q, pool.k_cache(0), pool.v_cache(0), meta, 0.2)
    expected = dense_reference(q, meta, keys, values, 0.2)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_forward_replans_for_a_new_batch() -> None:
    """Planning is per batch: a forward with different metadata must not reuse stale indices."""
    generator = torch.Generator().manual_seed(7)
    backend = TorchPagedAttention(4, 2)
    for rows in (MIXED_ROWS, DECODE_ROWS):
        pool, meta, keys, values = scattered_batch(rows, 16, 2, 16, torch.float32, generator)
        q = torch.randn(meta.num_tokens, 4, 16, generator=generator)
        out = backend.forward(q, pool.k_cache(0), pool.v_cache(0), meta, 0.25)
        expected = dense_reference(q, meta, keys, values, 0.25)
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_rejects_heads_that_do_not_group() -> None:
    with pytest.raises(ValueError):
        TorchPagedAttention(6, 4)


def test_build_attention_metadata_by_hand() -> None:
    """page_size 4; the second row ends exactly on a page boundary (kv_len 8)."""
    meta = build_attention_metadata(
        kv_starts=[0, 5, 8],
        q_lens=[3, 3, 1],
        page_tables=[[7, 2], [1, 9, 4], [3, 0, 5, 6]],
        page_size=4,
    )
    assert meta.qo_indptr.tolist() == [0, 3, 6, 7]
    assert meta.kv_indptr.tolist() == [0, 1, 3, 6]
    assert meta.kv_indices.tolist() == [7, 1, 9, 3, 0, 5]
    assert meta.kv_last_page_len.tolist() == [3, 4, 1]
    assert meta.positions.tolist() == [0, 1, 2, 5, 6, 7, 8]
    assert meta.slot_mapping.tolist() == [28, 29, 30, 37, 38, 39, 20]
    assert meta.q_lens == (3, 3, 1) and meta.kv_lens == (3, 8, 9)
    assert meta.qo_indptr.dtype == meta.kv_indptr.dtype == meta.kv_indices.dtype == torch.int32
    assert meta.kv_last_page_len.dtype == torch.int32
    assert meta.slot_mapping.dtype == meta.positions.dtype == torch.int64
    assert not meta.is_decode_only and meta.batch_size == 3 and meta.num_tokens == 7


def test_build_attention_metadata_rejects_bad_rows() -> None:
    with pytest.raises(ValueError):
        build_attention_metadata([0], [0], [[1]], 4)
    with pytest.raises(ValueError):
        build_attention_metadata([4], [1], [[1]], 4)


def test_select_backend_on_cpu() -> None:
    args = ("cpu", 4, 2, 16, torch.float32)
    assert isinstance(make_attention_backend("torch", *args), TorchPagedAttention)
    assert isinstance(make_attention_backend("auto", *args), TorchPagedAttention)
    with pytest.raises(ValueError, match="CUDA"):
        make_attention_backend("flashinfer", *args)
    with pytest.raises(ValueError, match="unknown"):
        make_attention_backend("sdpa", *args)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_torch_backend_on_cuda() -> None:
    generator = torch.Generator().manual_seed(3)
    pool, meta, keys, values = scattered_batch(MIXED_ROWS, 16, 2, 64, torch.float32, generator)
    q = torch.randn(meta.num_tokens, 8, 64, generator=generator)
    cuda_meta = build_attention_metadata(
        [kv - n for kv, n in zip(meta.kv_lens, meta.q_lens, strict=True)],
        meta.q_lens,
        [meta.kv_indices[s:e].tolist() for s, e in itertools.pairwise(meta.kv_indptr.tolist())],
        16,
        device="cuda",
    )
    backend = TorchPagedAttention(8, 2)
    out = backend.forward(
        q.cuda(), pool.k_cache(0).cuda(), pool.v_cache(0).cuda(), cuda_meta, 0.125
    )
    expected = dense_reference(q, meta, keys, values, 0.125)
    torch.testing.assert_close(out.cpu().double(), expected, atol=1e-4, rtol=1e-4)
