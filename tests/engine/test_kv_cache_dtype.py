"""--kv-cache-dtype end to end: the engine's pool takes the dtype and the pages it buys, the
native kernels keep serving over it with the torch path's tokens, a draft model's pool shares
it, and auto and float32 leave a float32 engine as it was."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers.decode_steps import CountingStep

from baton import LLM, SamplingParams
from baton.engine.cpu.capabilities import detect_cpu_capabilities
from baton.hardware import isa_rank

pytestmark = pytest.mark.skipif(
    isa_rank(detect_cpu_capabilities().isa) < isa_rank("avx2") or shutil.which("cc") is None,
    reason="the native kernels need an AVX2 CPU and a C compiler",
)

GREEDY = SamplingParams(temperature=0, max_tokens=60)
# 100 float32 pages of stories260K (5 layers of 4 KV heads of 8 values: 20 KiB a page of 16
# tokens), a few requests of its 512 positions; the cap on pages (what --max-num-seqs requests
# could fill) lies above what any dtype here buys.
POOL_BYTES = 100 * 20 << 10
SMALL_POOL = {"kv_cache_memory_bytes": POOL_BYTES, "max_running_requests": 64}


def _stories(stories260k_dir: Path, **config: object) -> LLM:
    return LLM(str(stories260k_dir), **SMALL_POOL, **config)


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "fp8_e4m3"])
def test_the_native_kernels_keep_the_torch_paths_tokens(
    stories260k_dir: Path, kv_cache_dtype: str
) -> None:
    """stories260K (float32) stores and attends natively over the narrower cache, the torch
    backend without native kernels over the same dtype: the same greedy text."""
    native = _stories(stories260k_dir, kv_cache_dtype=kv_cache_dtype)
    plain = _stories(stories260k_dir, kv_cache_dtype=kv_cache_dtype, max_cpu_isa="default")
    assert native.engine.attention.native is not None and plain.engine.attention.native is None
    prompts = ["The little dog", "Once upon a time, there was a big"]
    got = [output.token_ids for output in native.generate(prompts, GREEDY)]
    assert got == [output.token_ids for output in plain.generate(prompts, GREEDY)]


def test_pages_follow_the_element_size_and_auto_is_float32(stories260k_dir: Path) -> None:
    """The same budget buys twice the pages in bf16 and four times in fp8; auto and float32
    are one engine, token for token."""
    names = ("auto", "float32", "bfloat16", "fp8")
    engines = {name: _stories(stories260k_dir, kv_cache_dtype=name) for name in names}
    dtypes = [llm.engine.kv_pool.k_cache(0).dtype for llm in engines.values()]
    assert dtypes == [torch.float32, torch.float32, torch.bfloat16, torch.float8_e4m3fn]
    pages = [llm.engine.num_pages for llm in engines.values()]
    assert pages == [100, 100, 200, 400]
    assert {llm.engine.kv_pool.nbytes for llm in engines.values()} == {POOL_BYTES}
    auto, float32 = (engines[name].generate(["The little dog"], GREEDY) for name in names[:2])
    assert auto[0].token_ids == float32[0].token_ids


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "fp8_e5m2"])
def test_the_native_decode_step_keeps_the_eager_tokens(
    tiny_model_factory: Callable[..., Path], kv_cache_dtype: str
) -> None:
    """A bf16 checkpoint computed in float32 keeps its one-call decode step over a narrower
    cache, token for token with the model's forward op by op (--enforce-eager)."""
    path = tiny_model_factory("qwen3", weights_dtype=torch.bfloat16)
    config = {"dtype": "float32", "kv_cache_dtype": kv_cache_dtype}
    native = LLM(str(path), **config)
    eager = LLM(str(path), enforce_eager=True, **config)
    counting = native.engine.decode_step = CountingStep(native.engine.decode_step)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[(7 * i + j) % 250 for j in range(3 + 5 * i)] for i in range(5)]
    got = [output.token_ids for output in native.generate(prompts, params)]
    assert got == [output.token_ids for output in eager.generate(prompts, params)]
    assert counting.batches == 11


def test_a_draft_models_pool_shares_the_dtype(tiny_llama_dir: Path) -> None:
    """The draft's K/V round as the target's: the same model drafting for itself keeps its
    greedy tokens."""
    spec = {"method": "draft_model", "model": str(tiny_llama_dir), "num_speculative_tokens": 3}
    config = {"dtype": "float32", "kv_cache_dtype": "fp8", "num_pages": 64}
    drafted = LLM(str(tiny_llama_dir), speculative_config=spec, **config)
    plain = LLM(str(tiny_llama_dir), **config)
    assert drafted.engine.speculator.drafter.kv_pool.k_cache(0).dtype == torch.float8_e4m3fn
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [[(5 * j) % 250 for j in range(20)]]
    got = drafted.generate(prompts, params)[0].token_ids
    assert got == plain.generate(prompts, params)[0].token_ids
