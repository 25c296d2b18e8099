"""FlashInfer paged attention for CUDA: a thin adapter from AttentionMetadata to its wrappers.

`flashinfer` is imported only when the backend is built, so this module imports anywhere. The
exact arguments of every flashinfer call come from `FlashInferCalls`, which needs no GPU, so a
CPU test can bind them to the installed flashinfer's signatures and catch API drift.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
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
    # The window of the layers these calls serve, as FlashInfer counts it: the keys before a
    # query's own that it sees; -1: all of them. A plan fixes it (run() asserts the planned
    # one), so layers of different windows need wrappers of their own (`for_window`).
    window_left: int = -1
    # Gemma 2's attention soft cap, cap * tanh(score / cap) before the softmax; None: none.
    logits_soft_cap: float | None = None

    def for_window(self, window: int | None) -> FlashInferCalls:
        """These calls for the layers of `window` (ModelConfig.layer_windows; None: full)."""
        return replace(self, window_left=-1 if window is None else window - 1)

    def _plan_options(self) -> dict[str, Any]:
        """The plans' window and soft-cap keywords, where there are any."""
        options: dict[str, Any] = {}
        if self.window_left >= 0:
            options["window_left"] = self.window_left
        if self.logits_soft_cap is not None:
            options["logits_soft_cap"] = self.logits_soft_cap
        return options

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
            **self._plan_options(),
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
        return args, kwargs | self._plan_options()

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> CallArgs:
        """For either wrapper's run(...)."""
        return (q, (k_cache, v_cache)), {}


def calls_by_window(
    calls: FlashInferCalls, windows: tuple[int | None, ...]
) -> dict[int | None, FlashInferCalls]:
    """`calls` for each distinct window of `windows` (ModelConfig.layer_windows), in layer
    order: one for a model whose layers share one (Llama's None, Mistral v0.1's), two for
    Gemma's sliding and global layers."""
    return {window: calls.for_window(window) for window in dict.fromkeys(windows or (None,))}


class FlashInferAttention(AttentionBackend):
    """Batch prefill (any q_len > 1) or batch decode wrappers over the paged cache (CUDA only):
    a pair for each distinct window of the model's layers (`windows`), all planned each batch,
    each layer run on its window's; Gemma 2's soft cap (`softcap`) planned into every one.

    The pairs share one workspace: FlashInfer keeps each wrapper's plan in buffers of its own
    and uses the workspace only while a layer runs, one layer after another on one stream."""

    def __init__(
        self,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
        windows: tuple[int | None, ...] = (None,),
        softcap: float | None = None,
        scale: float | None = None,
    ) -> None:
        import flashinfer

        calls = FlashInferCalls(num_q_heads, num_kv_heads, head_dim, dtype, logits_soft_cap=softcap)
        self.calls = calls_by_window(calls, windows)
        workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=device)
        self._prefill: dict[int | None, Any] = {}
        self._decode: dict[int | None, Any] = {}
        for window, window_calls in self.calls.items():
            args, kwargs = window_calls.prefill_wrapper(workspace)
            self._prefill[window] = flashinfer.BatchPrefillWithPagedKVCacheWrapper(*args, **kwargs)
            args, kwargs = window_calls.decode_wrapper(workspace)
            self._decode[window] = flashinfer.BatchDecodeWithPagedKVCacheWrapper(*args, **kwargs)
        # sm_scale is fixed at plan time: plan with the model's (ModelConfig.attention_scale)
        # and re-plan if a layer asks for another (later batches then plan with that one).
        self.scale = head_dim**-0.5 if scale is None else scale
        self._meta: AttentionMetadata | None = None

    def plan(self, meta: AttentionMetadata) -> None:
        """Plan the wrappers this batch needs: decode if every row has one query, else prefill."""
        self._plan(meta, self.scale)

    def _plan(self, meta: AttentionMetadata, scale: float) -> None:
        for window, calls in self.calls.items():
            if meta.is_decode_only:
                args, kwargs = calls.decode_plan(meta, scale)
                self._decode[window].plan(*args, **kwargs)
            else:
                args, kwargs = calls.prefill_plan(meta, scale)
                self._prefill[window].plan(*args, **kwargs)
        self._meta, self.scale = meta, scale

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
        """Run the wrapper planned for this layer's window; see AttentionBackend."""
        calls = planned_calls(self.calls, window, softcap)
        if meta is not self._meta or scale != self.scale:
            self._plan(meta, scale)
        wrappers = self._decode if meta.is_decode_only else self._prefill
        args, kwargs = calls.run(q, k_cache, v_cache)
        return wrappers[window].run(*args, **kwargs)


def planned_calls(
    calls: Mapping[int | None, FlashInferCalls], window: int | None, softcap: float | None
) -> FlashInferCalls:
    """The calls planned for a layer of `window` and `softcap`; a ValueError for a layer the
    backend was not built for (a plan cannot change either between layers)."""
    found = calls.get(window)
    if found is None or found.logits_soft_cap != softcap:
        planned = {w: c.logits_soft_cap for w, c in calls.items()}
        raise ValueError(
            f"attention planned for windows and soft caps {planned}, "
            f"a layer asks for window {window} and soft cap {softcap}"
        )
    return found


class FlashInferGraphDecode(AttentionBackend):
    """FlashInfer's decode wrappers for one recorded batch size (CUDA graphs), one per window as
    FlashInferAttention's: their index buffers are that size's views of the step's persistent
    ones; `plan` runs on the host before each replay, `forward` inside the graph, never
    re-planning."""

    def __init__(
        self,
        calls: Mapping[int | None, FlashInferCalls],
        scale: float,
        workspace: torch.Tensor,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        kv_last_page_len: torch.Tensor,
    ) -> None:
        import flashinfer

        self.calls = calls
        buffers = (kv_indptr, kv_indices, kv_last_page_len)
        self._decode = {}
        for window, window_calls in calls.items():
            args, kwargs = window_calls.graph_decode_wrapper(workspace, *buffers)
            self._decode[window] = flashinfer.BatchDecodeWithPagedKVCacheWrapper(*args, **kwargs)
        # As the decoder layers compute it, to the last bit: forward() compares the two.
        self._scale = scale

    def plan(self, meta: AttentionMetadata) -> None:
        """Plan the next replay (host work, outside the graph)."""
        for window, calls in self.calls.items():
            args, kwargs = calls.decode_plan(meta, self._scale)
            self._decode[window].plan(*args, **kwargs)

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
        """Run the wrapper planned for this layer's window; see AttentionBackend."""
        calls = planned_calls(self.calls, window, softcap)
        if scale != self._scale:  # raised while recording, at start-up, never at a replay
            raise ValueError(f"decode graphs plan attention at {self._scale}, not {scale}")
        args, kwargs = calls.run(q, k_cache, v_cache)
        return self._decode[window].run(*args, **kwargs)
