"""The KV pool on a CPU: zero-filled, aligned as torch aligns, and resident only as its pages
are written (the default pool is 4 GiB; torch.zeros made all of it resident at start-up)."""

from __future__ import annotations

import torch

from baton.engine.kv.pool import KVPool


def _resident_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / 2**20


def test_a_pool_is_resident_as_its_pages_fill_not_at_its_size() -> None:
    """Bounds far below the pool's 1 GiB (which torch.zeros made resident at once), far above
    the pages written (16 MiB) and what torch's first ops allocate besides."""
    before = _resident_mib()
    pool = KVPool(16, 4096, 16, 2, 64, torch.float32, "cpu")  # 1 GiB
    assert pool.nbytes == 1 << 30
    assert _resident_mib() - before < 256  # reserved, not touched
    slots = torch.arange(0, 64 * 16, 16)  # one token in each of 64 pages
    for layer in range(16):
        pool.write(layer, torch.ones(64, 2, 64), torch.ones(64, 2, 64), slots)
    assert _resident_mib() - before < 512  # the written pages (64 of 4096), not the pool
    assert pool.k_cache(3)[5, 0].sum() == 128 and pool.v_cache(3)[5, 1].abs().sum() == 0
    assert pool.k_cache(15)[4095].abs().sum() == 0


def test_a_pool_of_every_dtype_is_zero_and_aligned_as_torch_aligns() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        pool = KVPool(2, 8, 16, 2, 24, dtype, "cpu")
        storage = pool.k_cache(0)
        assert storage.dtype == dtype and storage.shape == (8, 16, 2, 24)
        assert storage.data_ptr() % 64 == 0 and not storage.any()
