"""A prefill row's causal attention on AMX (native/attention/amx_attention.c), on CPUs with AMX
only: against a float64 softmax of the same bf16 operands (and at least as close as torch's bf16
flash kernel), over scattered cache rows, after a cached prefix, with grouped heads; and a
served bf16 model whose chunked prefill attends there, against transformers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import assert_greedy_matches_hf
from helpers.attention_reference import (
    attend_prefill_row,
    causal_float64,
    flash_error,
    scattered_prefill_row,
)

from baton import LLM, SamplingParams
from baton.engine.cpu.capabilities import detect_cpu_capabilities
from baton.engine.native.library import NativeKernels

# Probabilities rounded to bf16 for P V, as torch's bf16 flash kernel rounds them.
BF16_ATTENTION_TOLERANCE = 1e-2
BF16_TIE_TOLERANCE = 0.5


@pytest.fixture(scope="module")
def amx(native: NativeKernels) -> NativeKernels:
    if not native.amx:
        pytest.skip("needs a CPU with AMX-BF16 (and a kernel that lends its tiles)")
    return native


# (queries, cached prefix, query heads, KV heads, head_dim): one query; a partial block of
# grouped heads; blocks of 16 and 32 queries after a prefix; the 0.5B shape's 1024-token prompt;
# head_dim 128 past a long prefix.
@pytest.mark.parametrize(
    ("q_len", "prefix", "heads", "kv_heads", "head_dim"),
    [(1, 0, 2, 1, 32), (5, 0, 14, 2, 64), (33, 7, 4, 2, 64), (100, 40, 4, 4, 32),
     (1024, 0, 14, 2, 64), (70, 300, 8, 2, 128)],
)  # fmt: skip
def test_attention_matches_a_float64_softmax_of_its_bf16_operands(
    amx: NativeKernels, q_len: int, prefix: int, heads: int, kv_heads: int, head_dim: int
) -> None:
    row = scattered_prefill_row(q_len, prefix, heads, kv_heads, head_dim)
    out = attend_prefill_row(amx, row, on_amx=True)
    bf16 = [t.to(torch.bfloat16) for t in (row.q, row.keys, row.values)]
    want = causal_float64(*bf16, prefix)
    error = float((out.double() - want).abs().max())
    assert error < BF16_ATTENTION_TOLERANCE
    if prefix == 0:
        assert error <= flash_error(*bf16, want)


def test_a_served_chunked_prefill_attends_on_amx(
    amx: NativeKernels,
    tiny_model_factory: Callable[..., Path],
    prefill_attention_calls: list[tuple[int, int, bool]],
) -> None:
    """This machine's plan on a bf16 checkpoint of head_dim 64: a prompt of three chunks (the
    later two after their cached prefix) attends on AMX in every layer, with transformers'
    tokens up to bf16's near-ties."""
    if detect_cpu_capabilities().isa != "amx":
        pytest.skip("the plan is capped below AMX here (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA)")
    path = tiny_model_factory(
        "qwen2", weights_dtype=torch.bfloat16, hidden_size=256, num_attention_heads=4
    )
    llm = LLM(str(path), chunk_size=128)
    assert llm.engine.attention.amx_prefill
    prompt = [(13 * j) % 250 for j in range(300)]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    [output] = llm.generate([prompt], greedy)
    layers = len(llm.engine.model.layers)
    chunks = [(128, 0, True)] * layers + [(128, 128, True)] * layers + [(44, 256, True)] * layers
    assert prefill_attention_calls == chunks
    assert_greedy_matches_hf(path, prompt, output.token_ids, BF16_TIE_TOLERANCE)
