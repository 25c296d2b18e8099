"""A prefill row's causal attention on AMX (native/amx_attention.c), on CPUs with AMX only:
against a float64 softmax of the same bf16 operands (and at least as close as torch's bf16
flash kernel), over scattered cache rows, after a cached prefix, with grouped heads; and a
served bf16 model whose chunked prefill attends there, against transformers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_greedy_matches_hf

from baton import LLM, SamplingParams
from baton.engine.cpu_capabilities import detect_cpu_capabilities
from baton.engine.native.library import NativeKernels

# Probabilities rounded to bf16 for P V, as torch's bf16 flash kernel rounds them.
BF16_ATTENTION_TOLERANCE = 1e-2
BF16_TIE_TOLERANCE = 0.5


@pytest.fixture(scope="module")
def amx(native: NativeKernels) -> NativeKernels:
    if not native.amx:
        pytest.skip("needs a CPU with AMX-BF16 (and a kernel that lends its tiles)")
    return native


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int) -> torch.Tensor:
    """Causal attention in float64 of bf16-rounded q [q_len, heads, d], k/v [kv_heads, keys, d]."""
    q_len, heads, head_dim = q.shape
    group = heads // k.shape[0]
    q, k, v = (t.to(torch.bfloat16).double() for t in (q, k, v))
    hidden = torch.arange(k.shape[1])[None, :] > (prefix + torch.arange(q_len))[:, None]
    out = torch.empty(q_len, heads, head_dim, dtype=torch.float64)
    for head in range(heads):
        scores = (q[:, head] @ k[head // group].T * head_dim**-0.5).masked_fill(hidden, -torch.inf)
        out[:, head] = torch.softmax(scores, -1) @ v[head // group]
    return out


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
    amx.prefill_attention(
        q, prefix, k_cache, v_cache, kv_rows, head_dim**-0.5, out[1:-1], on_amx=True
    )
    assert out[0].isnan().all() and out[-1].isnan().all()
    k, v = k_cache[slot_of].transpose(0, 1), v_cache[slot_of].transpose(0, 1)
    want = _reference(q, k, v, prefix)
    error = (out[1:-1].double() - want).abs().max()
    assert error < BF16_ATTENTION_TOLERANCE
    if prefix == 0:
        bf16 = [t.to(torch.bfloat16).unsqueeze(0) for t in (q.transpose(0, 1), k, v)]
        flash = F.scaled_dot_product_attention(*bf16, is_causal=True, enable_gqa=True)
        assert error <= (flash[0].transpose(0, 1).double() - want).abs().max()


def test_a_head_dim_the_tiles_cannot_take_is_refused(amx: NativeKernels) -> None:
    q = torch.zeros(4, 2, 48)
    with pytest.raises(ValueError, match="no native prefill attention"):
        amx.prefill_attention(
            q,
            0,
            torch.zeros(8, 1, 48),
            torch.zeros(8, 1, 48),
            torch.arange(4),
            1.0,
            q.clone(),
            on_amx=True,
        )


def test_a_served_chunked_prefill_attends_on_amx(
    amx: NativeKernels,
    tiny_model_factory: Callable[..., Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """This machine's plan on a bf16 checkpoint of head_dim 64: a prompt of three chunks (the
    later two after their cached prefix) attends on AMX in every layer, with transformers'
    tokens up to bf16's near-ties."""
    if detect_cpu_capabilities().isa != "amx":
        pytest.skip("the plan is capped below AMX here (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA)")
    calls = []
    attention = NativeKernels.prefill_attention

    def counting(self, q, prefix, *args, on_amx):
        calls.append((q.shape[0], prefix, on_amx))
        return attention(self, q, prefix, *args, on_amx=on_amx)

    monkeypatch.setattr(NativeKernels, "prefill_attention", counting)
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
    assert calls == chunks
    assert_greedy_matches_hf(path, prompt, output.token_ids, BF16_TIE_TOLERANCE)
