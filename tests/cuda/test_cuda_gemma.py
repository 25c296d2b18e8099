"""Gemma on FlashInfer (CUDA): sliding and global layers on a wrapper pair each, scores soft-capped,
the model's own scale; against the torch backend and a float64 reference layer by layer, and the
tiny Gemma 2 served greedy (decode graphs and eagerly) against transformers. Skips without a CUDA
GPU and flashinfer; `scripts/gpu/run_cuda_checks.sh` runs it once `flashinfer_warmup.py
--gemma` has built these kernels (bf16, head_dim 128)."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import assert_greedy_matches_hf
from helpers.attention_reference import dense_reference, scattered_batch
from helpers.cuda_runs import greedy_graphed_and_eager

from baton import SamplingParams
from baton.engine.attention.flashinfer_backend import FlashInferAttention, flashinfer_available
from baton.engine.attention.torch_backend import TorchPagedAttention

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not flashinfer_available(), reason="flashinfer is not importable here"),
]

# (cached prefix, new tokens) per row: prefill chunks past the window and within it, decode
# rows with a few keys and with many more than the window.
ROWS = {
    "mixed": [(0, 13), (5, 1), (37, 1), (20, 9), (0, 150), (130, 1), (200, 61)],
    "decode": [(40, 1), (3, 1), (15, 1), (0, 1), (300, 1)],
}
WINDOW, SOFTCAP, SCALE = 16, 50.0, 24**-0.5
BF16_TOLERANCE = 3e-2  # as tests/cuda/test_cuda_engine.py's against float64
BF16_TIE_TOLERANCE = 0.5  # ditto: a greedy token may differ only at a closer top two


@pytest.mark.parametrize("rows", sorted(ROWS))
def test_flashinfer_gemma_layers_bf16_hd128(rows: str) -> None:
    """A sliding layer and a global one of the same batch, each on its own planned wrapper."""
    generator = torch.Generator().manual_seed(len(rows))
    pool, meta, keys, values = scattered_batch(
        ROWS[rows], 16, 4, 128, torch.bfloat16, generator, "cuda"
    )
    q = torch.randn(meta.num_tokens, 8, 128, generator=generator).to("cuda", torch.bfloat16)
    flashinfer = FlashInferAttention(
        8, 4, 128, torch.bfloat16, "cuda", windows=(WINDOW, None), softcap=SOFTCAP, scale=SCALE
    )
    reference = TorchPagedAttention(8, 4)
    flashinfer.plan(meta)
    reference.plan(meta)
    k_cache, v_cache = pool.k_cache(0), pool.v_cache(0)
    for window in (WINDOW, None):
        out = flashinfer.forward(q, k_cache, v_cache, meta, SCALE, window, SOFTCAP)
        theirs = reference.forward(q, k_cache, v_cache, meta, SCALE, window, SOFTCAP)
        expected = dense_reference(q, meta, keys, values, SCALE, window, SOFTCAP)
        torch.cuda.synchronize()
        torch.testing.assert_close(
            out.double().cpu(), expected, atol=BF16_TOLERANCE, rtol=BF16_TOLERANCE
        )
        tolerance = 2 * BF16_TOLERANCE
        torch.testing.assert_close(out, theirs, atol=tolerance, rtol=tolerance)


def test_flashinfer_gemma_engine_bf16_hd128(tiny_model_factory) -> None:
    """The tiny Gemma 2 (a window of 16, caps 8 and 12, scale 1 / sqrt(24)) in bf16 on FlashInfer:
    decode graphs replayed and eager steps give the same tokens, transformers' own up to bf16
    near-ties, prompts past the window."""
    model_dir = tiny_model_factory("gemma2", head_dim=128)
    rng = random.Random(2)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (1, 9, 17, 40, 100)]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    graphed, eager = greedy_graphed_and_eager(
        model_dir, prompts, greedy, attention_backend="flashinfer", cuda_graph_max_bs=8
    )
    assert graphed == eager
    for prompt, tokens in zip(prompts, graphed):
        assert_greedy_matches_hf(model_dir, prompt, tokens, tolerance=BF16_TIE_TOLERANCE)
