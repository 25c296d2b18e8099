"""A prefill row's causal attention in float32 (native/attention/prefill_attention.c), where the
plan computes in float32: against a float64 softmax (and at least as close as torch's float32 flash
kernel), over scattered cache rows, after a cached prefix, with grouped heads; and a served
float32 model whose chunked prefill attends there, token for token with transformers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import assert_greedy_matches_hf
from helpers.attention_reference import (
    attend_prefill_row,
    causal_float64,
    flash_error,
    scattered_prefill_row,
)

from baton import LLM, SamplingParams
from baton.engine.native.library import NativeKernels


# (queries, cached prefix, query heads, KV heads, head_dim): one query; blocks of 6 queries, the
# last partial, of SmolLM2's grouping (9 heads over 3); keys past a block of 16 after a prefix;
# a long prompt; head_dim 128 past a long prefix, and the largest head.
@pytest.mark.parametrize(
    ("q_len", "prefix", "heads", "kv_heads", "head_dim"),
    [(1, 0, 2, 1, 16), (5, 0, 14, 2, 64), (13, 0, 9, 3, 64), (33, 7, 4, 2, 64),
     (100, 40, 4, 4, 32), (600, 0, 9, 3, 64), (70, 300, 8, 2, 128), (20, 5, 2, 2, 256)],
)  # fmt: skip
def test_attention_matches_a_float64_softmax(
    native: NativeKernels, q_len: int, prefix: int, heads: int, kv_heads: int, head_dim: int
) -> None:
    row = scattered_prefill_row(q_len, prefix, heads, kv_heads, head_dim)
    out = attend_prefill_row(native, row, on_amx=False)
    want = causal_float64(row.q, row.keys, row.values, prefix)
    error = float((out.double() - want).abs().max())
    assert error < 1e-5
    if prefix == 0:
        assert error <= 2 * flash_error(row.q, row.keys, row.values, want)


# Windows of one key (the query's own), inside a key block, across blocks of 16 after a prefix,
# wider than the row; soft caps far below the scores' spread.
@pytest.mark.parametrize(
    ("q_len", "prefix", "window", "softcap"),
    [(13, 0, 1, None), (40, 0, 5, None), (33, 70, 20, None), (70, 300, 64, 3.0), (20, 5, 100, 1.5),
     (9, 0, None, 0.5)],
)  # fmt: skip
def test_a_window_and_a_soft_cap_match_a_float64_softmax(
    native: NativeKernels, q_len: int, prefix: int, window: int | None, softcap: float | None
) -> None:
    row = scattered_prefill_row(q_len, prefix, 4, 2, 64)
    out = attend_prefill_row(native, row, on_amx=False, window=window, softcap=softcap)
    want = causal_float64(row.q, row.keys, row.values, prefix, window, softcap)
    assert float((out.double() - want).abs().max()) < 1e-5


# The float32 kernel takes head_dim in steps of 16, the AMX one in steps of 32.
@pytest.mark.parametrize(("on_amx", "head_dim"), [(False, 40), (True, 48)], ids=["f32", "amx"])
def test_a_head_dim_off_the_kernels_steps_is_refused(
    native: NativeKernels, on_amx: bool, head_dim: int
) -> None:
    if on_amx and not native.amx:
        pytest.skip("needs a CPU with AMX-BF16 (and a kernel that lends its tiles)")
    row = scattered_prefill_row(4, 0, 2, 1, head_dim)
    with pytest.raises(ValueError, match="no native prefill attention"):
        attend_prefill_row(native, row, on_amx=on_amx)


def test_a_served_chunked_float32_prefill_attends_natively(
    native: NativeKernels,
    tiny_model_factory: Callable[..., Path],
    prefill_attention_calls: list[tuple[int, int, bool]],
) -> None:
    """A float32 checkpoint of head_dim 16: a prompt of three chunks (the later two after their
    cached prefix) attends in the float32 kernel in every layer, with transformers' tokens."""
    path = tiny_model_factory("qwen2")
    llm = LLM(str(path), chunk_size=128, dtype="float32")
    prompt = [(13 * j) % 250 for j in range(300)]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    [output] = llm.generate([prompt], greedy)
    layers = len(llm.engine.model.layers)
    chunks = [(128, 0, False)] * layers + [(128, 128, False)] * layers
    assert prefill_attention_calls == chunks + [(44, 256, False)] * layers
    assert_greedy_matches_hf(path, prompt, output.token_ids)
