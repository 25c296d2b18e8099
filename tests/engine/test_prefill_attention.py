"""A prefill row's causal attention in float32 (native/prefill_attention.c), where the plan
computes in float32: against a float64 softmax (and at least as close as torch's float32 flash
kernel), over scattered cache rows, after a cached prefix, with grouped heads; and a served
float32 model whose chunked prefill attends there, token for token with transformers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_greedy_matches_hf

from baton import LLM, SamplingParams
from baton.engine.native.library import NativeKernels


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int) -> torch.Tensor:
    """Causal attention in float64 of q [q_len, heads, d] over k/v [kv_heads, keys, d]."""
    q_len, heads, head_dim = q.shape
    group = heads // k.shape[0]
    q, k, v = (t.double() for t in (q, k, v))
    hidden = torch.arange(k.shape[1])[None, :] > (prefix + torch.arange(q_len))[:, None]
    out = torch.empty(q_len, heads, head_dim, dtype=torch.float64)
    for head in range(heads):
        scores = (q[:, head] @ k[head // group].T * head_dim**-0.5).masked_fill(hidden, -torch.inf)
        out[:, head] = torch.softmax(scores, -1) @ v[head // group]
    return out


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
    generator = torch.Generator().manual_seed(q_len + prefix + head_dim)
    keys, slots = prefix + q_len, 2 * (prefix + q_len) + 5
    k_cache = torch.randn(slots, kv_heads, head_dim, generator=generator)
    v_cache = torch.randn(slots, kv_heads, head_dim, generator=generator)
    # The row's keys lie in scattered slots, as pages do; kv_rows is the backend's head-major
    # list of cache rows (slot * kv_heads + head).
    slot_of = torch.randperm(slots, generator=generator)[:keys]
    kv_rows = (slot_of[None, :] * kv_heads + torch.arange(kv_heads)[:, None]).reshape(-1)
    # q strided as the model's qkv product holds it; out's other rows stay untouched.
    qkv = torch.randn(q_len, heads * head_dim + 24, generator=generator)
    q = qkv[:, : heads * head_dim].view(q_len, heads, head_dim)
    out = torch.full((q_len + 2, heads, head_dim), torch.nan)
    native.prefill_attention(
        q, prefix, k_cache, v_cache, kv_rows, head_dim**-0.5, out[1:-1], on_amx=False
    )
    assert out[0].isnan().all() and out[-1].isnan().all()
    k, v = k_cache[slot_of].transpose(0, 1), v_cache[slot_of].transpose(0, 1)
    want = _reference(q, k, v, prefix)
    error = (out[1:-1].double() - want).abs().max()
    assert error < 1e-5
    if prefix == 0:
        flash = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), is_causal=True,
            enable_gqa=True,
        )  # fmt: skip
        assert error <= 2 * (flash[0].transpose(0, 1).double() - want).abs().max()


def test_a_head_dim_off_the_vectors_is_refused(native: NativeKernels) -> None:
    q = torch.zeros(4, 2, 40)
    with pytest.raises(ValueError, match="no native prefill attention"):
        native.prefill_attention(
            q,
            0,
            torch.zeros(8, 1, 40),
            torch.zeros(8, 1, 40),
            torch.arange(4),
            1.0,
            q.clone(),
            on_amx=False,
        )


def test_a_served_chunked_float32_prefill_attends_natively(
    native: NativeKernels,
    tiny_model_factory: Callable[..., Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A float32 checkpoint of head_dim 16: a prompt of three chunks (the later two after their
    cached prefix) attends in the float32 kernel in every layer, with transformers' tokens."""
    calls = []
    attention = NativeKernels.prefill_attention

    def counting(self, q, prefix, *args, on_amx):
        calls.append((q.shape[0], prefix, on_amx))
        return attention(self, q, prefix, *args, on_amx=on_amx)

    monkeypatch.setattr(NativeKernels, "prefill_attention", counting)
    path = tiny_model_factory("qwen2")
    llm = LLM(str(path), chunk_size=128, dtype="float32")
    prompt = [(13 * j) % 250 for j in range(300)]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    [output] = llm.generate([prompt], greedy)
    layers = len(llm.engine.model.layers)
    chunks = [(128, 0, False)] * layers + [(128, 128, False)] * layers
    assert calls == chunks + [(44, 256, False)] * layers
    assert_greedy_matches_hf(path, prompt, output.token_ids)
