"""FlashInfer over layers of different windows and a soft cap (Gemma 2 and 3): a wrapper pair per
distinct window, each planned with its window, the soft cap and the model's scale, and each layer
run on its own window's; the decode graphs' wrappers likewise. No GPU and no flashinfer needed:
a stand-in module records the wrappers' calls (test_flashinfer_api.py binds the same calls to
the real signatures where flashinfer is installed)."""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from baton.checkpoint.load import load_checkpoint
from baton.engine.attention import select
from baton.engine.attention.flashinfer_backend import FlashInferAttention, FlashInferGraphDecode
from baton.engine.attention.metadata import build_attention_metadata

MIXED = build_attention_metadata([0, 7], [5, 1], [[3, 1], [0, 2]], page_size=4)
DECODE_ONLY = build_attention_metadata([7, 2], [1, 1], [[3, 1], [0, 2]], page_size=4)
CACHE = torch.empty(4, 4, 2, 32)


class RecordingWrapper:
    """Stands in for a flashinfer wrapper: keeps its construction's keywords and its calls."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.plans: list[dict[str, Any]] = []
        self.runs = 0

    def plan(self, *args: Any, **kwargs: Any) -> None:
        self.plans.append(kwargs)

    def run(self, q: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.runs += 1
        return q


@pytest.fixture(autouse=True)
def stand_in_flashinfer(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("flashinfer")
    module.BatchPrefillWithPagedKVCacheWrapper = type("Prefill", (RecordingWrapper,), {})
    module.BatchDecodeWithPagedKVCacheWrapper = type("Decode", (RecordingWrapper,), {})
    monkeypatch.setitem(sys.modules, "flashinfer", module)


def gemma_backend() -> FlashInferAttention:
    """Gemma 2's pattern: sliding layers of 16 tokens between global ones, scores capped at 8,
    scaled by 1 / sqrt(24)."""
    return FlashInferAttention(
        4, 2, 32, torch.float32, "cpu", 16, windows=(16, None, 16), softcap=8.0, scale=24**-0.5
    )


def test_each_window_gets_wrappers_planned_with_it_and_the_cap() -> None:
    backend = gemma_backend()
    assert list(backend.calls) == [16, None]
    for meta, wrappers in ((MIXED, backend._prefill), (DECODE_ONLY, backend._decode)):
        backend.plan(meta)
        sliding, full = wrappers[16].plans[-1], wrappers[None].plans[-1]
        assert sliding["window_left"] == 15  # the 15 keys before a query's own
        assert "window_left" not in full
        assert sliding["logits_soft_cap"] == full["logits_soft_cap"] == 8.0
        assert sliding["sm_scale"] == full["sm_scale"] == 24**-0.5


def test_each_layer_runs_on_its_windows_wrapper() -> None:
    backend = gemma_backend()
    for meta, wrappers in ((MIXED, backend._prefill), (DECODE_ONLY, backend._decode)):
        backend.plan(meta)
        q = torch.randn(meta.num_tokens, 4, 32)
        for window in (16, None, 16):
            assert backend.forward(q, CACHE, CACHE, meta, 24**-0.5, window, 8.0) is q
        assert (wrappers[16].runs, wrappers[None].runs) == (2, 1)
        assert all(len(wrapper.plans) == 1 for wrapper in wrappers.values())  # no re-plan


@pytest.mark.parametrize(("window", "softcap"), [(8, 8.0), (16, None), (None, 50.0)])
def test_a_layer_it_was_not_planned_for_is_refused(window: int | None, softcap: float) -> None:
    backend = gemma_backend()
    backend.plan(MIXED)
    q = torch.randn(MIXED.num_tokens, 4, 32)
    with pytest.raises(ValueError, match="a layer asks for window") as refused:
        backend.forward(q, CACHE, CACHE, MIXED, 24**-0.5, window, softcap)
    assert "\n" not in str(refused.value)


def test_one_window_for_every_layer_is_one_pair() -> None:
    """Llama (no window) and Mistral v0.1 (one for every layer): one pair, no soft cap."""
    for windows, planned in (((), None), ((None, None), None), ((48, 48), 47)):
        backend = FlashInferAttention(4, 2, 32, torch.float32, "cpu", 16, windows=windows)
        assert len(backend.calls) == 1
        backend.plan(MIXED)
        (wrapper,) = backend._prefill.values()
        assert wrapper.plans[-1].get("window_left") == planned
        assert "logits_soft_cap" not in wrapper.plans[-1]
        assert wrapper.plans[-1]["sm_scale"] == 32**-0.5


def test_graph_decode_plans_every_window_at_the_models_scale() -> None:
    calls = gemma_backend().calls
    buffers = (torch.zeros(3, dtype=torch.int32), torch.zeros(8, dtype=torch.int32))
    buffers += (torch.ones(2, dtype=torch.int32),)
    graph = FlashInferGraphDecode(calls, 24**-0.5, torch.empty(16), *buffers)
    assert all(wrapper.kwargs["use_cuda_graph"] for wrapper in graph._decode.values())
    graph.plan(DECODE_ONLY)
    assert graph._decode[16].plans[-1]["window_left"] == 15
    assert {wrapper.plans[-1]["sm_scale"] for wrapper in graph._decode.values()} == {24**-0.5}
    q = torch.randn(2, 4, 32)
    graph.forward(q, CACHE, CACHE, DECODE_ONLY, 24**-0.5, None, 8.0)
    assert (graph._decode[16].runs, graph._decode[None].runs) == (0, 1)
    with pytest.raises(ValueError, match="decode graphs plan attention at"):
        graph.forward(q, CACHE, CACHE, DECODE_ONLY, 32**-0.5, 16, 8.0)


@pytest.mark.parametrize("variant", ["gemma2", "gemma3"])
def test_the_backend_is_built_with_the_models_windows_cap_and_scale(
    tiny_model_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch, variant: str
) -> None:
    """What model_attention_backend hands FlashInfer (CUDA itself is not needed to check it)."""
    config = load_checkpoint(str(tiny_model_factory(variant))).config
    built: dict[str, Any] = {}
    monkeypatch.setattr(select, "FlashInferAttention", lambda *args, **kwargs: built.update(kwargs))
    select.model_attention_backend("flashinfer", config, torch.bfloat16, "cuda")
    assert built["windows"] == config.layer_windows and len(set(config.layer_windows)) == 2
    assert built["softcap"] == config.gemma.attn_logit_softcapping
    assert built["scale"] == config.gemma.query_pre_attn_scalar**-0.5
