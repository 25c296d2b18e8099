"""How many pages the KV pool gets: `--num-gpu-blocks-override`, else what the
`--kv-cache-memory-bytes` budget holds, capped by what every admissible request could fill."""

from __future__ import annotations

import torch

from baton.checkpoint.model_config import ModelConfig
from baton.config import BatonConfig, ConfigurationError
from baton.engine.kv.pool import KVPool


def page_bytes(model_config: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
    """Memory one page of `dtype` takes across `model_config`'s layers, K and V."""
    return KVPool.bytes_per_page(
        model_config.num_layers, page_size, model_config.num_kv_heads, model_config.head_dim, dtype
    )


def kv_pool_pages(
    config: BatonConfig, model_config: ModelConfig, dtype: torch.dtype, max_model_len: int
) -> int:
    """The pool's page count for a cache of `dtype` (--kv-cache-dtype's: a narrower one holds
    more pages in the same budget). ConfigurationError unless it holds one request of
    `max_model_len` tokens: one that does not fit could never finish, however long it waited."""
    page_size = config.page_size
    bytes_per_page = page_bytes(model_config, page_size, dtype)
    pages_needed = -(-max_model_len // page_size)
    num_pages = config.num_pages
    if not num_pages:
        by_budget = config.kv_cache_memory_bytes // bytes_per_page
        # More pages than every admissible request could fill at once would only waste memory.
        num_pages = max(1, min(by_budget, config.max_running_requests * pages_needed))
    capacity = num_pages * page_size
    if capacity >= max_model_len:
        return num_pages
    if config.num_pages is not None:
        fix = f"--num-gpu-blocks-override at least {pages_needed}"
    else:
        fix = f"--kv-cache-memory-bytes at least {pages_needed * bytes_per_page}"
    raise ConfigurationError(
        f"the KV cache holds {capacity} tokens ({num_pages} pages of {page_size}), "
        f"less than one request of max_model_len {max_model_len}: give {fix}, "
        f"or --max-model-len {capacity} or less"
    )
