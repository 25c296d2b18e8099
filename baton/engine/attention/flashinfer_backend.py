"""FlashInfer paged attention for CUDA: a thin adapter from AttentionMetadata to its wrappers.

`flashinfer` is imported only when the backend is built, so this module imports anywhere. The
exact arguments of every flashinfer call come from `FlashInferCalls`, which needs no GPU, so a
CPU test can bind them to the installed flashinfer's signatures and catch API drift.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch

from baton.engine.attention.base import AttentionBackend
from baton.engine.attention.metadata import AttentionMetadata

logger = logging.getLogger(__name__)

CallArgs = tuple[tuple[Any, ...], dict[str, Any]]

DEFAULT_WORKSPACE_BYTES = 128 * 1024 * 1024


def flashinfer_available() -> bool:
    """Whether `import flashinfer` works here (it can fail on missing CUDA libraries too)."""
    try:
        import flashinfer  # noqa: F401
    except (ImportError, OSError) as error:
        logger.info("flashinfer unavailable: %s", error)
        return False
    return True


@dataclass(frozen=True)
class FlashInferCalls:
    """Builds the (args, kwargs) of each flashinfer call the backend makes."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    # Every layer's window (ModelConfig.layer_windows; FlashInfer plans one for the batch), as
    # FlashInfer counts it: the keys before a query's own that it sees; -1: all of them.
    window_left: int = -1

    def _window(self) -> dict[str, Any]:
        """The plans' window keyword, where there is a window."""
        return {} if self.window_left < 0 else {"window_left": self.window_left}

    def prefill_wrapper(self, workspace: torch.Tensor) -> CallArgs:
        """For BatchPrefillWithPagedKVCacheWrapper(...); our cache is [pages, page, heads, dim]."""
        return (workspace,), {"kv_layout": "NHD"}

    def decode_wrapper(self, workspace: torch.Tensor) -> CallArgs:
        """For BatchDecodeWithPagedKVCacheWrapper(...)."""
        # FlashInfer's guidance: the tensor-core (prefill) kernels win for wide query groups.
        use_tensor_cores = self.num_q_heads // self.num_kv_heads >= 4
        return (workspace,), {"kv_layout": "NHD", "use_tensor_cores": use_tensor_cores}

    def graph_decode_wrapper(
        self,
        workspace: torch.Tensor,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        kv_last_page_len: torch.Tensor,
    ) -> CallArgs:
        """For BatchDecodeWithPagedKVCacheWrapper(...) replayed inside a CUDA graph: one per
        captured batch size, over that size's views of the step's persistent index buffers
        (engine/graphs/decode_inputs.py), which its plan() reads in place before each replay."""
        args, kwargs = self.decode_wrapper(workspace)
        kwargs |= {
            "use_cuda_graph": True,
            "paged_kv_indptr_buffer": kv_indptr,
            "paged_kv_indices_buffer": kv_indices,
            "paged_kv_last_page_len_buffer": kv_last_page_len,
        }
        return args, kwargs

    def prefill_plan(self, meta: AttentionMetadata, scale: float) -> CallArgs:
        """For BatchPrefillWithPagedKVCacheWrapper.plan(...)."""
        args = (
            meta.qo_indptr,
            meta.kv_indptr,
            meta.kv_indices,
            meta.kv_last_page_len,
            self.num_q_heads,
            self.num_kv_heads,
            self.head_dim,
            meta.page_size,
        )
        kwargs = {
            "causal": True,
            "sm_scale": scale,
            "q_data_type": self.dtype,
            "kv_data_type": self.dtype,
            **self._window(),
        }
        return args, kwargs

    def decode_plan(self, meta: AttentionMetadata, scale: float) -> CallArgs:
        """For BatchDecodeWithPagedKVCacheWrapper.plan(...)."""
        args = (
            meta.kv_indptr,
            meta.kv_indices,
            meta.kv_last_page_len,
            self.num_q_heads,
            self.num_kv_heads,
            self.head_dim,
            meta.page_size,
        )
        kwargs = {"sm_scale": scale, "q_data_type": self.dtype, "kv_data_type": self.dtype}
        return args, kwargs | self._window()

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> CallArgs:
        """For either wrapper's run(...)."""
        return (q, (k_cache, v_cache)), {}


class FlashInferAttention(AttentionBackend):
    """Batch prefill (any q_len > 1) or batch decode wrappers over the paged cache (CUDA only),
    over one `window` for every layer where the model has one (Mistral v0.1, Phi-3); no soft
    cap (select.py refuses models whose layers differ or cap their scores)."""

    def __init__(
        self,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
        window: int | None = None,
    ) -> None:
        import flashinfer

        window_left = -1 if window is None else window - 1  # (vLLM's sliding_window - 1)
        self.calls = FlashInferCalls(num_q_heads, num_kv_heads, head_dim, dtype, window_left)
        workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=device)
        args, kwargs = self.calls.prefill_wrapper(workspace)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(*args, **kwargs)
        args, kwargs = self.calls.decode_wrapper(workspace)
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(*args, **kwargs)
        # sm_scale is fixed at plan time; plan with the usual scale and re-plan if a layer
        # asks for another (then later batches plan with that one from the start).
        self._scale = 1.0 / math.sqrt(head_dim)
        self._meta: AttentionMetadata | None = None

    def plan(self, meta: AttentionMetadata) -> None:
        """Plan the wrapper this batch needs: decode if every row has one query, else prefill."""
        self._plan(meta, self._scale)

    def _plan(self, meta: AttentionMetadata, scale: float) -> None:
        if meta.is_decode_only:
            args, kwargs = self.calls.decode_plan(meta, scale)
            self._decode.plan(*args, **kwargs)
        else:
            args, kwargs = self.calls.prefill_plan(meta, scale)
            self._prefill.plan(*args, **kwargs)
        self._meta, self._scale = meta, scale

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
        """Run the planned wrapper for one layer (its window the planned one); see
        AttentionBackend."""
        if meta is not self._meta or scale != self._scale:
            self._plan(meta, scale)
        wrapper = self._decode if meta.is_decode_only else self._prefill
        args, kwargs = self.calls.run(q, k_cache, v_cache)
        return wrapper.run(*args, **kwargs)


class FlashInferGraphDecode(AttentionBackend):
    """FlashInfer's decode wrapper for one recorded batch size (CUDA graphs): its index buffers
    are that size's views of the step's persistent ones; `plan` runs on the host before each
    replay, `forward` runs inside the graph and never re-plans."""

    def __init__(
        self,
        calls: FlashInferCalls,
        workspace: torch.Tensor,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        kv_last_page_len: torch.Tensor,
    ) -> None:
        import flashinfer

        self.calls = calls
        buffers = (kv_indptr, kv_indices, kv_last_page_len)
        args, kwargs = calls.graph_decode_wrapper(workspace, *buffers)
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(*args, **kwargs)
        # As the decoder layers compute it, to the last bit: forward() compares the two.
        self._scale = calls.head_dim**-0.5

    def plan(self, meta: AttentionMetadata) -> None:
        """Plan the next replay (host work, outside the graph)."""
        args, kwargs = self.calls.decode_plan(meta, self._scale)
        self._decode.plan(*args, **kwargs)

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
        """Run the planned wrapper for one layer (its window the planned one); see
        AttentionBackend."""
        if scale != self._scale:  # raised while recording, at start-up, never at a replay
            raise ValueError(f"decode graphs plan attention at 1/sqrt(head_dim), not {scale}")
        args, kwargs = self.calls.run(q, k_cache, v_cache)
        return self._decode.run(*args, **kwargs)
