"""Recording an engine's decode graphs on CUDA: the persistent inputs, one FlashInfer decode
wrapper per batch size over them, and the graphs themselves, all at start-up."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

import torch

from baton.engine.attention.flashinfer_backend import (
    DEFAULT_WORKSPACE_BYTES,
    FlashInferCalls,
    FlashInferGraphDecode,
)
from baton.engine.graphs.buckets import graph_batch_sizes
from baton.engine.graphs.decode_graphs import DecodeGraphs, cuda_graph_recorder
from baton.engine.graphs.decode_inputs import DecodeInputs
from baton.engine.kv.pool import KVPool
from baton.engine.models.causal_lm import CausalLM

logger = logging.getLogger(__name__)


def record_decode_graphs(
    model: CausalLM,
    kv_pool: KVPool,
    calls: Mapping[int | None, FlashInferCalls],
    scale: float,
    max_rows: int,
    max_model_len: int,
) -> DecodeGraphs:
    """Decode graphs of up to `max_rows` rows over `kv_pool`, whose last page the caller keeps
    from every request: the padding rows' page. `calls`, `scale`: the eager backend's
    (FlashInferAttention), a wrapper per window, planned at the model's scale."""
    device = kv_pool.k_cache(0).device
    page_size = kv_pool.page_size
    inputs = DecodeInputs(
        max_rows, -(-max_model_len // page_size), page_size, kv_pool.num_pages - 1, device
    )
    workspace = torch.empty(DEFAULT_WORKSPACE_BYTES, dtype=torch.uint8, device=device)

    def attention_for(size: int) -> FlashInferGraphDecode:
        return FlashInferGraphDecode(
            calls,
            scale,
            workspace,
            inputs.kv_indptr[: size + 1],
            inputs.kv_indices,
            inputs.kv_last_page_len[:size],
        )

    started = time.perf_counter()
    sizes = graph_batch_sizes(max_rows)
    with torch.inference_mode():
        graphs = DecodeGraphs(
            model,
            kv_pool,
            inputs,
            sizes,
            attention_for,
            cuda_graph_recorder(device),
        )
    logger.info(
        "decode graphs of %s rows recorded in %.1f s",
        ", ".join(map(str, sizes)),
        time.perf_counter() - started,
    )
    return graphs
