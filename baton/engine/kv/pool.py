"""The paged KV pool: per-layer K and V tensors of shape [num_pages, page_size, kv_heads, head_dim].

The pool only stores; who owns which page is the scheduler's business (`PageAllocator` and the
radix cache).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from baton.checkpoint.model_config import ModelConfig
from baton.engine.kv.cache_dtype import to_cache_dtype


class KVPool:
    """K/V storage for every layer, carved out of one allocation."""

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        # Zero-filled so padded reads in a backend never meet NaNs from uninitialised memory.
        self._storage = _zeroed(
            (num_layers, 2, num_pages, page_size, num_kv_heads, head_dim), dtype, device
        )

    @classmethod
    def for_model(
        cls,
        config: ModelConfig,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> KVPool:
        """A pool shaped for `config`'s layers and KV heads."""
        return cls(
            config.num_layers,
            num_pages,
            page_size,
            config.num_kv_heads,
            config.head_dim,
            dtype,
            device,
        )

    @staticmethod
    def bytes_per_page(
        num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Memory one page takes across all layers, K and V."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return num_layers * 2 * page_size * num_kv_heads * head_dim * itemsize

    def k_cache(self, layer: int) -> torch.Tensor:
        return self._storage[layer, 0]

    def v_cache(self, layer: int) -> torch.Tensor:
        return self._storage[layer, 1]

    def write(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Store new K/V ([tokens, kv_heads, head_dim]) at flat slots page * page_size + offset,
        rounded into the pool's dtype (cache_dtype.py)."""
        for cache, new in ((self._storage[layer, 0], k), (self._storage[layer, 1], v)):
            flat = cache.view(-1, *new.shape[1:])
            stored = to_cache_dtype(new, flat.dtype)
            if flat.element_size() == 1:  # torch has no index_copy_ for float8: their bytes
                flat, stored = flat.view(torch.uint8), stored.view(torch.uint8)
            flat.index_copy_(0, slot_mapping, stored)

    @property
    def nbytes(self) -> int:
        """The pool's size (on a CPU, reserved: resident only as its pages fill)."""
        return self._storage.nbytes


_ALIGNMENT = 64


def _zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zero-filled tensor. On a CPU its memory comes from calloc (numpy's zeros), whose large
    blocks the kernel maps as zero pages on first touch: resident memory follows the pages in
    use, not the pool's size. torch.zeros writes every byte at start-up (the default 4 GiB pool
    was 4 GiB resident before the first request)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    # From a 64-byte boundary, as torch aligns its own allocations: the kernels read the pages'
    # rows whole, and a row straddling cache lines costs a second line.
    block = np.zeros(nbytes + _ALIGNMENT, dtype=np.uint8)
    start = -block.ctypes.data % _ALIGNMENT
    return torch.from_numpy(block[start : start + nbytes]).view(dtype).view(shape)
