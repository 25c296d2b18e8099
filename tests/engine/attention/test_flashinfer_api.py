"""Binds every flashinfer call of FlashInferAttention to the installed flashinfer's signatures.

No GPU needed: the wrappers are replaced by recorders that check each call against the real
class's signature, so API drift in a flashinfer upgrade fails here on CPU.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest
import torch

from baton.engine.attention.flashinfer_backend import FlashInferAttention, FlashInferCalls
from baton.engine.attention.metadata import build_attention_metadata
from baton.engine.graphs.decode_inputs import DecodeInputs

flashinfer = pytest.importorskip("flashinfer")

PREFILL = flashinfer.BatchPrefillWithPagedKVCacheWrapper
DECODE = flashinfer.BatchDecodeWithPagedKVCacheWrapper
CALLS = FlashInferCalls(num_q_heads=8, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
MIXED = build_attention_metadata([0, 7], [5, 1], [[3, 1], [0, 2]], page_size=4)
DECODE_ONLY = build_attention_metadata([7, 2], [1, 1], [[3, 1], [0, 2]], page_size=4)


def _bind(function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Bind like a real call would; where `function` swallows **kwargs, bind those to the
    implementation it forwards them to too, so misspelt keywords still fail."""
    signature = inspect.signature(function)
    signature.bind(*args, **kwargs)
    takes_any_keyword = any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values()
    )
    implementation = getattr(type(args[0]), f"_{function.__name__}_impl", None)
    if takes_any_keyword and kwargs:
        assert implementation is not None, f"cannot check keywords {list(kwargs)} of {function}"
        inspect.signature(implementation).bind(*args, **kwargs)


def test_wrapper_constructors_bind() -> None:
    workspace = torch.empty(16, dtype=torch.uint8)
    for real, (args, kwargs) in [
        (PREFILL, CALLS.prefill_wrapper(workspace)),
        (DECODE, CALLS.decode_wrapper(workspace)),
    ]:
        inspect.signature(real).bind(*args, **kwargs)


def test_graph_decode_wrapper_binds_with_the_steps_buffers() -> None:
    """The CUDA-graph decode wrapper of one captured size takes that size's views of the step's
    persistent buffers as its fixed index buffers."""
    inputs = DecodeInputs(max_rows=8, max_pages_per_row=4, page_size=4, dummy_page=0, device="cpu")
    bucket = 4
    buffers = (inputs.kv_indptr[: bucket + 1], inputs.kv_indices, inputs.kv_last_page_len[:bucket])
    args, kwargs = CALLS.graph_decode_wrapper(torch.empty(16, dtype=torch.uint8), *buffers)
    bound = inspect.signature(DECODE).bind(*args, **kwargs).arguments
    assert bound["use_cuda_graph"] is True
    assert bound["paged_kv_indptr_buffer"].data_ptr() == inputs.kv_indptr.data_ptr()
    assert bound["paged_kv_indices_buffer"] is inputs.kv_indices
    assert bound["paged_kv_last_page_len_buffer"].shape == (bucket,)


def test_plan_and_run_bind() -> None:
    q = torch.empty(MIXED.num_tokens, 8, 64, dtype=torch.bfloat16)
    cache = torch.empty(4, 4, 2, 64, dtype=torch.bfloat16)
    run_args, run_kwargs = CALLS.run(q, cache, cache)
    for real, (args, kwargs) in [
        (PREFILL, CALLS.prefill_plan(MIXED, 0.125)),
        (DECODE, CALLS.decode_plan(DECODE_ONLY, 0.125)),
    ]:
        wrapper = real.__new__(real)  # unconstructed: only its bound methods are inspected
        _bind(real.plan, (wrapper, *args), kwargs)
        _bind(real.run, (wrapper, *run_args), run_kwargs)


def test_prefill_plan_is_causal_with_our_metadata() -> None:
    args, kwargs = CALLS.prefill_plan(MIXED, 0.125)
    bound = inspect.signature(PREFILL.plan).bind(None, *args, **kwargs).arguments
    assert bound["causal"] is True
    assert bound["qo_indptr"] is MIXED.qo_indptr
    assert bound["paged_kv_last_page_len"] is MIXED.kv_last_page_len
    assert (bound["num_qo_heads"], bound["num_kv_heads"], bound["page_size"]) == (8, 2, 4)


def _recorder(real: type) -> type:
    """A stand-in wrapper class that checks every call against `real` and records it."""

    class Recorder:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            inspect.signature(real).bind(*args, **kwargs)
            self.calls: list[str] = []

        def plan(self, *args: Any, **kwargs: Any) -> None:
            _bind(real.plan, (real.__new__(real), *args), kwargs)
            self.calls.append(f"plan:{kwargs['sm_scale']}")

        def run(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            _bind(real.run, (real.__new__(real), *args), kwargs)
            self.calls.append("run")
            return torch.zeros_like(args[0])

    return Recorder


def test_backend_routes_batches_through_checked_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flashinfer, "BatchPrefillWithPagedKVCacheWrapper", _recorder(PREFILL))
    monkeypatch.setattr(flashinfer, "BatchDecodeWithPagedKVCacheWrapper", _recorder(DECODE))
    backend = FlashInferAttention(8, 2, 64, torch.bfloat16, "cpu", workspace_bytes=16)
    cache = torch.empty(4, 4, 2, 64, dtype=torch.bfloat16)
    for meta in (MIXED, DECODE_ONLY):
        backend.plan(meta)
        q = torch.empty(meta.num_tokens, 8, 64, dtype=torch.bfloat16)
        for _ in range(2):
            assert backend.forward(q, cache, cache, meta, 0.1).shape == q.shape
    # plan() starts from 1/sqrt(64); the layers' other scale re-plans once, then sticks.
    assert backend._prefill[None].calls == ["plan:0.125", "plan:0.1", "run", "run"]
    assert backend._decode[None].calls == ["plan:0.1", "run", "run"]


def test_windowed_soft_capped_layers_bind(monkeypatch: pytest.MonkeyPatch) -> None:
    """Gemma 2's plans (a window, a soft cap, its own scale) bind to the real signatures, a
    wrapper pair per window (test_flashinfer_windows.py checks which layer runs on which)."""
    monkeypatch.setattr(flashinfer, "BatchPrefillWithPagedKVCacheWrapper", _recorder(PREFILL))
    monkeypatch.setattr(flashinfer, "BatchDecodeWithPagedKVCacheWrapper", _recorder(DECODE))
    backend = FlashInferAttention(
        8, 2, 64, torch.bfloat16, "cpu", 16, windows=(16, None), softcap=50.0, scale=0.0625
    )
    cache = torch.empty(4, 4, 2, 64, dtype=torch.bfloat16)
    for meta in (MIXED, DECODE_ONLY):
        backend.plan(meta)
        q = torch.empty(meta.num_tokens, 8, 64, dtype=torch.bfloat16)
        for window in (16, None):
            assert backend.forward(q, cache, cache, meta, 0.0625, window, 50.0).shape == q.shape
    for wrappers in (backend._prefill, backend._decode):
        assert [wrapper.calls for wrapper in wrappers.values()] == [["plan:0.0625", "run"]] * 2
