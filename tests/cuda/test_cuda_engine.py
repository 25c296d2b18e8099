"""The engine on a CUDA GPU: greedy tokens and logits against transformers, the torch paged
backend against a dense reference, and the FlashInfer backend against both.

All 53 passed on an H200 (torch 2.11.0+cu130, FlashInfer 0.5.3) on 2026-11-28 (a116f7c); figures in
docs/benchmarks.md. Every test here skips without a CUDA device (CI has none); the FlashInfer
ones also skip where `flashinfer` does not import. `scripts/gpu/run_cuda_checks.sh` runs them
on a GPU machine. With BATON_CUDA_METRICS set to a file, each test appends its numbers (max abs
differences, tokens matched) to it, one line per case.

FlashInfer compiles its kernels on first use (a few minutes per dtype and head_dim);
`scripts/gpu/flashinfer_warmup.py` builds the modules these tests need ahead of them. The
FlashInfer cases' ids name their dtype and head_dim (`bf16-hd128`, ...) so that `-k` can pick
the ones already built.
"""

from __future__ import annotations

import gc
import math
import os
import random
from pathlib import Path

import pytest
import torch
from helpers import CORE_VARIANTS, assert_greedy_matches_hf, hf_greedy_generate, hf_logits
from helpers.attention_reference import dense_reference, scattered_batch

from baton import LLM, SamplingParams
from baton.checkpoint.load import load_checkpoint
from baton.engine.attention.base import AttentionBackend
from baton.engine.attention.flashinfer_backend import FlashInferAttention, flashinfer_available
from baton.engine.attention.metadata import AttentionMetadata, build_attention_metadata
from baton.engine.attention.torch_backend import TorchPagedAttention
from baton.engine.kv.pool import KVPool
from baton.engine.models.causal_lm import CausalLM
from baton.engine.weights.checkpoint_tensors import iter_weights

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEVICE = "cuda"
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}

# (cached prefix, new tokens) per row: prefill chunks with and without a prefix, decode rows
# between them (so decode queries are not contiguous), a row whose kv length is a multiple of 16,
# a decode row with a single key, and rows past 128 keys (more than one kernel tile).
MIXED_ROWS = [
    (0, 13), (5, 1), (37, 1), (20, 9), (15, 1), (0, 1), (31, 17), (2, 2),
    (0, 150), (130, 1), (200, 61),
]  # fmt: skip
DECODE_ROWS = [(40, 1), (3, 1), (15, 1), (0, 1), (63, 1), (300, 1)]
ROWS = {"mixed": MIXED_ROWS, "decode": DECODE_ROWS}

# Against a float64 reference. The kernels round their probabilities to the cache dtype before
# the PV product, and the output to it at the end: a few units in the last place of |out| <~ 2.
REFERENCE_TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float32: 1e-5}

# Greedy decoding on the tiny models: prompts of several lengths, batched together (so batches
# mix prefill chunks and decode rows).
PROMPT_LENGTHS = (1, 5, 17, 40, 64, 100)
NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
# bf16 rounding moves these models' logits by up to ~0.2 each (tests/test_llm.py): a bf16
# engine's greedy token may differ from float32 transformers' only at a closer top two.
BF16_TIE_TOLERANCE = 0.5
FLOAT32_LOGITS_ATOL = 1e-4


def record(line: str) -> None:
    """Append one line of numbers to $BATON_CUDA_METRICS, where set (and print it)."""
    print(line)
    path = os.environ.get("BATON_CUDA_METRICS")
    if path:
        with open(path, "a") as metrics:
            metrics.write(line + "\n")


@pytest.fixture(autouse=True)
def _release_gpu_memory():
    yield
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture
def flashinfer_ready() -> None:
    """Skip where flashinfer does not import (not installed, or its CUDA libraries missing)."""
    if not flashinfer_available():
        pytest.skip("flashinfer is not importable here")


def random_prompts(lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(n)] for n in lengths]


def matched_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two continuations share."""
    count = 0
    for x, y in zip(a, b):
        if x != y:
            break
        count += 1
    return count


# --- attention backends -------------------------------------------------------------------------


def paged_batch(
    rows: list[tuple[int, int]],
    page_size: int,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int,
) -> tuple[KVPool, AttentionMetadata, torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """A pool on the GPU holding every row's K/V in scrambled pages (the CPU tests' batch), the
    batch's metadata, and its queries: a view of a fused [tokens, q_heads + kv_heads, head_dim]
    projection, strided as the model's q is (models/decoder_layer.py)."""
    generator = torch.Generator().manual_seed(seed)
    pool, meta, keys, values = scattered_batch(
        rows, page_size, kv_heads, head_dim, dtype, generator, DEVICE
    )
    fused = torch.randn(meta.num_tokens, q_heads + kv_heads, head_dim, generator=generator)
    q = fused.to(DEVICE, dtype)[:, :q_heads]
    return pool, meta, q, keys, values


def attend(
    backend: AttentionBackend,
    pool: KVPool,
    meta: AttentionMetadata,
    q: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    backend.plan(meta)
    out = backend.forward(q, pool.k_cache(0), pool.v_cache(0), meta, scale)
    torch.cuda.synchronize()
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device
    assert torch.isfinite(out).all()
    return out


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=DTYPE_NAMES.get
)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("rows", sorted(ROWS))
def test_torch_backend_on_cuda_matches_dense_reference(
    rows: str, page_size: int, dtype: torch.dtype
) -> None:
    """The torch backend runs unchanged on CUDA tensors (its prefill rows take the masked
    blocks there, and CUDA's fused kernels)."""
    pool, meta, q, keys, values = paged_batch(ROWS[rows], page_size, 8, 2, 128, dtype, seed=11)
    scale = 1.0 / math.sqrt(128)
    out = attend(TorchPagedAttention(8, 2), pool, meta, q, scale)
    expected = dense_reference(q, meta, keys, values, scale)
    record(
        f"torch-vs-dense {DTYPE_NAMES[dtype]} hd128 q8/kv2 page{page_size} {rows}: "
        f"max_abs={max_abs(out, expected):.3g}"
    )
    tolerance = REFERENCE_TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=tolerance)


# The FlashInfer cases, in the order their kernels are built (scripts/gpu/flashinfer_warmup.py):
# per dtype and head_dim, batch prefill (mixed batches), batch decode (decode-only, query groups
# under 4) and tensor-core decode (decode-only, groups of 4 or more: the prefill kernels).
FLASHINFER_KERNELS = [
    (torch.bfloat16, 128),
    (torch.float16, 64),
    (torch.bfloat16, 64),
    (torch.float16, 128),
]
FLASHINFER_HEADS = [(8, 2), (8, 4)]  # query groups of 4 (tensor-core decode) and of 2
FLASHINFER_CASES = [
    pytest.param(
        dtype,
        head_dim,
        page_size,
        rows,
        heads,
        id=f"{DTYPE_NAMES[dtype]}-hd{head_dim}-page{page_size}-{rows}-q{heads[0]}kv{heads[1]}",
    )
    for dtype, head_dim in FLASHINFER_KERNELS
    for rows in ("mixed", "decode")
    for page_size in (16, 1)
    for heads in FLASHINFER_HEADS
]


@pytest.mark.parametrize(("dtype", "head_dim", "page_size", "rows", "heads"), FLASHINFER_CASES)
def test_flashinfer_matches_torch_backend(
    flashinfer_ready: None,
    dtype: torch.dtype,
    head_dim: int,
    page_size: int,
    rows: str,
    heads: tuple[int, int],
) -> None:
    q_heads, kv_heads = heads
    seed = 100 * page_size + head_dim + q_heads + kv_heads
    pool, meta, q, keys, values = paged_batch(
        ROWS[rows], page_size, q_heads, kv_heads, head_dim, dtype, seed
    )
    scale = 1.0 / math.sqrt(head_dim)
    flashinfer_out = attend(
        FlashInferAttention(q_heads, kv_heads, head_dim, dtype, DEVICE), pool, meta, q, scale
    )
    torch_out = attend(TorchPagedAttention(q_heads, kv_heads), pool, meta, q, scale)
    expected = dense_reference(q, meta, keys, values, scale)
    record(
        f"flashinfer {DTYPE_NAMES[dtype]} hd{head_dim} q{q_heads}/kv{kv_heads} page{page_size} "
        f"{rows}: vs_torch max_abs={max_abs(flashinfer_out, torch_out):.3g} "
        f"vs_dense max_abs={max_abs(flashinfer_out, expected):.3g} "
        f"(torch vs_dense {max_abs(torch_out, expected):.3g})"
    )
    tolerance = REFERENCE_TOLERANCE[dtype]
    torch.testing.assert_close(flashinfer_out.double(), expected, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(flashinfer_out, torch_out, atol=2 * tolerance, rtol=2 * tolerance)


@pytest.mark.parametrize("rows", sorted(ROWS))
def test_flashinfer_replans_for_another_scale_bf16_hd128(flashinfer_ready: None, rows: str) -> None:
    """plan() assumes 1/sqrt(head_dim); a layer asking for another scale re-plans with it."""
    pool, meta, q, keys, values = paged_batch(ROWS[rows], 16, 8, 2, 128, torch.bfloat16, seed=5)
    backend = FlashInferAttention(8, 2, 128, torch.bfloat16, DEVICE)
    backend.plan(meta)
    out = backend.forward(q, pool.k_cache(0), pool.v_cache(0), meta, 0.05)
    expected = dense_reference(q, meta, keys, values, 0.05)
    record(
        f"flashinfer bf16 hd128 scale 0.05 {rows}: vs_dense max_abs={max_abs(out, expected):.3g}"
    )
    tolerance = REFERENCE_TOLERANCE[torch.bfloat16]
    torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=tolerance)


# --- the model and the engine against transformers ----------------------------------------------


@pytest.mark.parametrize("variant", CORE_VARIANTS)
def test_model_logits_match_transformers_on_cuda(tiny_model_factory, variant: str) -> None:
    """CausalLM on the GPU in float32, through a chunked prefill and decode steps over pages
    handed out in scrambled order, against transformers' float32 logits (on the CPU)."""
    model_dir = tiny_model_factory(variant)
    checkpoint = load_checkpoint(str(model_dir))
    config = checkpoint.config
    model = CausalLM(config, torch.float32, DEVICE)
    model.load_weights(iter_weights(checkpoint))
    page_size, num_pages = 4, 64
    pool = KVPool(
        config.num_layers, num_pages, page_size, config.num_kv_heads, config.head_dim,
        torch.float32, DEVICE,
    )  # fmt: skip
    attention = TorchPagedAttention(config.num_heads, config.num_kv_heads)
    table = torch.randperm(num_pages, generator=torch.Generator().manual_seed(0)).tolist()
    tokens = random_prompts((48,), seed=3)[0]
    reference = hf_logits(model_dir, tokens)
    worst = 0.0
    # Two prefill chunks (the second past a cached prefix), then one decode step per token.
    chunks = [(0, 20), (20, 40), *((i, i + 1) for i in range(40, 48))]
    for start, end in chunks:
        meta = build_attention_metadata([start], [end - start], [table], page_size, DEVICE)
        attention.plan(meta)
        logits = model(
            torch.tensor(tokens[start:end], device=DEVICE),
            meta.positions,
            pool,
            attention,
            meta,
            torch.arange(end - start, device=DEVICE),
        )
        assert logits.device.type == torch.device(DEVICE).type and logits.dtype == torch.float32
        expected = reference[start:end].to(DEVICE)
        worst = max(worst, max_abs(logits, expected))
        torch.testing.assert_close(logits, expected, rtol=0, atol=FLOAT32_LOGITS_ATOL)
    record(f"model logits fp32 {variant} vs transformers: max_abs={worst:.3g}")


def greedy_outputs(model_dir: Path, prompts: list[list[int]], **config: object) -> list[list[int]]:
    llm = LLM(str(model_dir), device=DEVICE, **config)
    assert llm.engine.device.type == "cuda"
    try:
        return [output.token_ids for output in llm.generate(prompts, GREEDY)]
    finally:
        del llm


@pytest.mark.parametrize("variant", CORE_VARIANTS)
def test_engine_greedy_matches_transformers_on_cuda(tiny_model_factory, variant: str) -> None:
    """The offline LLM (scheduler, engine, sampler) on the GPU in float32 with the torch
    attention backend: token for token transformers' float32 greedy continuations."""
    model_dir = tiny_model_factory(variant)
    prompts = random_prompts(PROMPT_LENGTHS)
    generated = greedy_outputs(model_dir, prompts, dtype="float32", attention_backend="torch")
    expected = [hf_greedy_generate(model_dir, prompt, NEW_TOKENS) for prompt in prompts]
    matched = sum(matched_prefix(g, e) for g, e in zip(generated, expected))
    record(
        f"engine fp32 torch-backend {variant}: {matched}/{len(prompts) * NEW_TOKENS} "
        "tokens equal to transformers"
    )
    for prompt, tokens in zip(prompts, generated):
        assert_greedy_matches_hf(model_dir, prompt, tokens)  # names the step of a divergence
    assert generated == expected


def test_flashinfer_engine_greedy_bf16_hd128(flashinfer_ready: None, tiny_model_factory) -> None:
    """The engine in bf16 with the FlashInfer backend, on a tiny Qwen3 with head_dim 128 (query
    groups of 2): greedy tokens transformers' own up to bf16 near-ties, and how many equal the
    torch backend's in bf16."""
    model_dir = tiny_model_factory("qwen3", head_dim=128)
    prompts = random_prompts(PROMPT_LENGTHS, seed=2)
    flashinfer_tokens = greedy_outputs(
        model_dir, prompts, dtype="bfloat16", attention_backend="flashinfer"
    )
    torch_tokens = greedy_outputs(model_dir, prompts, dtype="bfloat16", attention_backend="torch")
    expected = [hf_greedy_generate(model_dir, prompt, NEW_TOKENS) for prompt in prompts]
    total = len(prompts) * NEW_TOKENS
    same_as_torch = sum(matched_prefix(f, t) for f, t in zip(flashinfer_tokens, torch_tokens))
    same_as_hf = sum(matched_prefix(f, e) for f, e in zip(flashinfer_tokens, expected))
    torch_as_hf = sum(matched_prefix(t, e) for t, e in zip(torch_tokens, expected))
    record(
        f"engine bf16 qwen3-hd128: flashinfer=torch {same_as_torch}/{total}, "
        f"flashinfer=transformers(fp32) {same_as_hf}/{total}, "
        f"torch=transformers(fp32) {torch_as_hf}/{total}"
    )
    for prompt, tokens in zip(prompts, flashinfer_tokens):
        assert_greedy_matches_hf(model_dir, prompt, tokens, tolerance=BF16_TIE_TOLERANCE)
