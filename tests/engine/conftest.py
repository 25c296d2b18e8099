"""Fixtures of the engine's tests."""

from __future__ import annotations

import pytest
import torch

from baton.engine.cpu.capabilities import detect_cpu_capabilities
from baton.engine.native.library import NativeKernels, load_native_kernels
from baton.hardware import isa_rank


@pytest.fixture(scope="module")
def native() -> NativeKernels:
    """The native kernels; a test that asks for them skips on a CPU without AVX2."""
    if isa_rank(detect_cpu_capabilities().isa) < isa_rank("avx2"):
        pytest.skip("the native kernels need AVX2")
    return load_native_kernels()


@pytest.fixture
def prefill_attention_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, bool]]:
    """(queries, cached prefix, on_amx) of every native prefill attention call the test makes."""
    calls: list[tuple[int, int, bool]] = []
    attention = NativeKernels.prefill_attention

    def counting(
        self: NativeKernels,
        q: torch.Tensor,
        prefix: int,
        *args: object,
        on_amx: bool,
        **limits: object,  # the window and soft cap
    ) -> None:
        calls.append((q.shape[0], prefix, on_amx))
        return attention(self, q, prefix, *args, on_amx=on_amx, **limits)

    monkeypatch.setattr(NativeKernels, "prefill_attention", counting)
    return calls
