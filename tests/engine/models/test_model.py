"""Baton's CausalLM: weight loading, and logits against transformers' own models."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import assert_greedy_matches_hf, hf_greedy_generate, hf_logits
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from baton.checkpoint.load import Checkpoint, CheckpointError, load_checkpoint
from baton.checkpoint.random_model import RANDOM_HF_CONFIG
from baton.engine.attention.metadata import build_attention_metadata
from baton.engine.attention.torch_backend import TorchPagedAttention
from baton.engine.cpu.capabilities import detect_cpu_capabilities
from baton.engine.kv.pool import KVPool
from baton.engine.models.causal_lm import CausalLM
from baton.engine.models.layers import Linear
from baton.engine.weights.checkpoint_tensors import iter_weights

PAGE_SIZE = 4
NUM_PAGES = 48
# Float32 rounding differs between implementations by ~1e-5 at logit magnitudes ~6.
FLOAT32_ATOL = 1e-4


class PagedRunner:
    """Drives a CausalLM through a KV pool whose pages are handed out in scrambled order.

    Linear weights are packed for oneDNN where this CPU can pack their dtype, as the engine's
    compute plan packs them, unless `pack` is False.
    """

    def __init__(
        self, checkpoint: Checkpoint, dtype: torch.dtype = torch.float32, pack: bool = True
    ) -> None:
        config = checkpoint.config
        self.model = CausalLM(config, dtype, "cpu")
        self.model.load_weights(iter_weights(checkpoint))
        if pack and can_pack(dtype):
            self.model.pack_linear_weights()
        self.pool = KVPool(
            config.num_layers,
            NUM_PAGES,
            PAGE_SIZE,
            config.num_kv_heads,
            config.head_dim,
            dtype,
            "cpu",
        )
        self.attn = TorchPagedAttention(config.num_heads, config.num_kv_heads)
        self._free_pages = torch.randperm(
            NUM_PAGES, generator=torch.Generator().manual_seed(0)
        ).tolist()
        self._tables: dict[int, list[int]] = {}
        self._lengths: dict[int, int] = {}

    def step(self, chunks: dict[int, list[int]], all_logits: bool = False) -> list[torch.Tensor]:
        """Append each sequence's chunk; logits of each chunk's last token (or of all tokens)."""
        kv_starts, q_lens, tables, input_ids = [], [], [], []
        for seq, tokens in chunks.items():
            start = self._lengths.get(seq, 0)
            table = self._tables.setdefault(seq, [])
            while len(table) * PAGE_SIZE < start + len(tokens):
                table.append(self._free_pages.pop())
            kv_starts.append(start)
            q_lens.append(len(tokens))
            tables.append(table)
            input_ids.extend(tokens)
            self._lengths[seq] = start + len(tokens)
        meta = build_attention_metadata(kv_starts, q_lens, tables, PAGE_SIZE)
        ends = torch.tensor(q_lens).cumsum(0)
        indices = torch.arange(len(input_ids)) if all_logits else ends - 1
        self.attn.plan(meta)
        logits = self.model(
            torch.tensor(input_ids), meta.positions, self.pool, self.attn, meta, indices
        )
        if all_logits:
            return list(logits.split(q_lens))
        return list(logits)


def can_pack(dtype: torch.dtype) -> bool:
    """Whether oneDNN can pack weights of `dtype` on this CPU (see cpu_capabilities)."""
    return detect_cpu_capabilities().can_pack(str(dtype).removeprefix("torch."))


def _tokens(count: int, seed: int, vocab: int = 256) -> list[int]:
    return torch.randint(0, vocab, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_full_sequence_matches_transformers(tiny_model_dir: Path) -> None:
    tokens = _tokens(40, seed=1)
    runner = PagedRunner(load_checkpoint(str(tiny_model_dir)))
    [logits] = runner.step({0: tokens}, all_logits=True)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, hf_logits(tiny_model_dir, tokens), rtol=0, atol=FLOAT32_ATOL)


@pytest.mark.parametrize(
    ("variant", "overrides"),
    [
        ("qwen3", {"attention_bias": True}),  # Qwen3 puts it on q/k/v and o_proj alike
        ("llama", {"mlp_bias": True, "attention_bias": False, "tie_word_embeddings": True}),
    ],
)
def test_optional_biases_match_transformers(
    tiny_model_factory, variant: str, overrides: dict
) -> None:
    model_dir = tiny_model_factory(variant, **overrides)
    tokens = _tokens(20, seed=5)
    [logits] = PagedRunner(load_checkpoint(str(model_dir))).step({0: tokens}, all_logits=True)
    torch.testing.assert_close(logits, hf_logits(model_dir, tokens), rtol=0, atol=FLOAT32_ATOL)


def test_prefill_then_decode_matches_transformers(tiny_model_dir: Path) -> None:
    tokens = _tokens(23, seed=2)
    reference = hf_logits(tiny_model_dir, tokens)
    runner = PagedRunner(load_checkpoint(str(tiny_model_dir)))
    prefill = 7
    [logits] = runner.step({0: tokens[:prefill]})
    torch.testing.assert_close(logits, reference[prefill - 1], rtol=0, atol=FLOAT32_ATOL)
    for position in range(prefill, len(tokens)):
        [logits] = runner.step({0: [tokens[position]]})
        torch.testing.assert_close(logits, reference[position], rtol=0, atol=FLOAT32_ATOL)


def test_greedy_decode_matches_transformers_generate(tiny_model_dir: Path) -> None:
    prompt = _tokens(6, seed=6)
    runner = PagedRunner(load_checkpoint(str(tiny_model_dir)))
    [logits] = runner.step({0: prompt})
    generated = [int(logits.argmax())]
    for _ in range(39):
        [logits] = runner.step({0: generated[-1:]})
        generated.append(int(logits.argmax()))
    assert generated == hf_greedy_generate(tiny_model_dir, prompt, 40)
    assert len(set(generated)) > 10  # the tiny models do not collapse into repeating one token
    assert_greedy_matches_hf(tiny_model_dir, prompt, generated)
    with pytest.raises(AssertionError, match="step 5"):
        assert_greedy_matches_hf(tiny_model_dir, prompt, [*generated[:5], (generated[5] + 1) % 256])


def test_ragged_batch_with_chunked_prefill_matches_transformers(tiny_llama_dir: Path) -> None:
    """Decode rows, a first prefill chunk and a continued chunk in the same batches."""
    sequences = {seq: _tokens(30, seed=10 + seq) for seq in range(3)}
    references = {seq: hf_logits(tiny_llama_dir, tokens) for seq, tokens in sequences.items()}
    runner = PagedRunner(load_checkpoint(str(tiny_llama_dir)))
    runner.step({0: sequences[0][:9], 1: sequences[1][:1]})
    # Sequence 0 decodes while 1 continues its prefill and 2 starts one; then all three decode.
    schedule = [
        {0: (9, 10), 1: (1, 12), 2: (0, 5)},
        {2: (5, 6), 0: (10, 11), 1: (12, 13)},
        {1: (13, 20), 2: (6, 7), 0: (11, 12)},
    ]
    for batch in schedule:
        chunks = {seq: sequences[seq][start:end] for seq, (start, end) in batch.items()}
        for seq, logits in zip(batch, runner.step(chunks), strict=True):
            end = batch[seq][1]
            torch.testing.assert_close(logits, references[seq][end - 1], rtol=0, atol=FLOAT32_ATOL)


def test_logits_only_for_requested_rows(tiny_qwen3_dir: Path) -> None:
    tokens = _tokens(12, seed=3)
    runner = PagedRunner(load_checkpoint(str(tiny_qwen3_dir)))
    meta = build_attention_metadata([0], [len(tokens)], [[5, 1, 9]], PAGE_SIZE)
    runner.attn.plan(meta)
    indices = torch.tensor([2, 7, 11])
    logits = runner.model(
        torch.tensor(tokens), meta.positions, runner.pool, runner.attn, meta, indices
    )
    assert logits.shape == (3, runner.model.config.vocab_size)
    torch.testing.assert_close(
        logits, hf_logits(tiny_qwen3_dir, tokens)[indices], rtol=0, atol=FLOAT32_ATOL
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_weights_keep_the_logits(tiny_model_dir: Path, dtype: torch.dtype) -> None:
    """Packing changes how oneDNN multiplies, not what: float32 packed and plain weights take
    BLAS kernels whose summation orders differ, so rounding-level differences only (up to 7e-7
    seen on AMX). In bf16 the kernels differ by CPU kind (AMX tiles; on AVX512_BF16 CPUs without
    AMX, bit-identical results on Intel, not on AMD Zen 4), so what holds everywhere is
    accuracy: the packed weights' logits are as close to the float32 model's as the plain bf16
    weights' are (at worst and on average)."""
    if not can_pack(dtype):
        pytest.skip(f"oneDNN cannot pack {dtype} weights on this CPU: the plan never packs them")
    checkpoint = load_checkpoint(str(tiny_model_dir))
    packed, plain = PagedRunner(checkpoint, dtype), PagedRunner(checkpoint, dtype, pack=False)
    linears = [module for module in packed.model.modules() if isinstance(module, Linear)]
    assert linears and all(linear.packed for linear in linears)
    assert not any(module.packed for module in plain.model.modules() if isinstance(module, Linear))
    exact = PagedRunner(checkpoint, torch.float32, pack=False)
    tokens = _tokens(20, seed=5)
    for chunk in (tokens[:12], tokens[12:13], tokens[13:]):
        [ours], [reference] = packed.step({0: chunk}), plain.step({0: chunk})
        if dtype == torch.float32:
            torch.testing.assert_close(ours, reference, rtol=0, atol=1e-5)
            continue
        [float32] = exact.step({0: chunk})
        ours_error, plain_error = (ours - float32).abs(), (reference - float32).abs()
        assert ours_error.max() <= max(2 * plain_error.max(), 0.05), (ours_error, plain_error)
        assert ours_error.mean() <= 2 * plain_error.mean(), (ours_error, plain_error)


def test_bfloat16_is_close_to_transformers_bfloat16(tiny_model_dir: Path) -> None:
    tokens = _tokens(24, seed=4)
    runner = PagedRunner(load_checkpoint(str(tiny_model_dir)), dtype=torch.bfloat16)
    [logits] = runner.step({0: tokens[:16]}, all_logits=True)
    decoded = [runner.step({0: [token]})[0] for token in tokens[16:]]
    ours = torch.cat([logits, torch.stack(decoded)])
    assert ours.dtype == torch.float32 and runner.model.embed_tokens.dtype == torch.bfloat16
    exact = hf_logits(tiny_model_dir, tokens)
    hf_bf16 = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    with torch.no_grad():
        reference = hf_bf16(torch.tensor([tokens])).logits[0].float()
    # bf16 rounding moves these logits by up to ~0.2; ours must be about as far from float32 as
    # HF's own bf16 model is, both at worst and on average (argmax agreement is too fragile).
    ours_error, hf_error = (ours - exact).abs(), (reference - exact).abs()
    assert ours_error.max() < max(2 * hf_error.max(), 0.05), (ours_error.max(), hf_error.max())
    assert ours_error.mean() < 2 * hf_error.mean(), (ours_error.mean(), hf_error.mean())


def test_default_model_matches_transformers_llama(random_checkpoint: Checkpoint) -> None:
    """The built-in model is an ordinary Llama: transformers computes the same logits from it."""
    hf_config = {
        k: v for k, v in RANDOM_HF_CONFIG.items() if k not in ("architectures", "model_type")
    }
    reference_model = LlamaForCausalLM(LlamaConfig(**hf_config)).eval()
    reference_model.load_state_dict(dict(iter_weights(random_checkpoint)), strict=False)
    reference_model.tie_weights()
    tokens = random_checkpoint.tokenizer.encode("The default model speaks bytes: ünïcödé ✓")
    with torch.no_grad():
        reference = reference_model(torch.tensor([tokens])).logits[0]
    [logits] = PagedRunner(random_checkpoint).step({0: tokens}, all_logits=True)
    torch.testing.assert_close(logits, reference, rtol=0, atol=FLOAT32_ATOL)


def test_stories260k_matches_transformers(stories260k_dir: Path) -> None:
    checkpoint = load_checkpoint(str(stories260k_dir))
    tokens = checkpoint.tokenizer.encode("Once upon a time, there was a little girl named Lily.")
    reference = hf_logits(stories260k_dir, tokens)
    runner = PagedRunner(checkpoint)
    [prefill] = runner.step({0: tokens[:5]}, all_logits=True)
    decoded = [runner.step({0: [token]})[0] for token in tokens[5:]]
    torch.testing.assert_close(
        torch.cat([prefill, torch.stack(decoded)]), reference, rtol=0, atol=FLOAT32_ATOL
    )


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    return dict(iter_weights(load_checkpoint(str(model_dir))))


def _load(model_dir: Path, weights: dict[str, torch.Tensor]) -> CausalLM:
    config = load_checkpoint(str(model_dir)).config
    model = CausalLM(config, torch.float32, "cpu")
    model.load_weights(weights.items())
    return model


@pytest.mark.parametrize(
    ("tensor", "breakage", "message"),
    [
        ("model.layers.1.self_attn.k_proj.bias", "drop", "lacks 1 tensor.*k_proj.bias"),
        ("lm_head.weight", "drop", "lacks 1 tensor.*lm_head.weight"),
        ("model.layers.0.mlp.up_proj.weight", "reshape", "up_proj.weight.*shape"),
        ("model.layers.0.self_attn.q_proj.weight", "reshape", "q_proj.weight.*shape"),
        ("model.layers.0.self_attn.extra.weight", "add", "unexpected.*extra.weight"),
    ],
)
def test_bad_weights_name_the_tensor(
    tiny_llama_dir: Path, tensor: str, breakage: str, message: str
) -> None:
    weights = _weights(tiny_llama_dir)
    if breakage == "drop":
        del weights[tensor]
    elif breakage == "reshape":
        weights[tensor] = weights[tensor][:-1]
    else:
        weights[tensor] = torch.zeros(3)
    with pytest.raises(CheckpointError, match=message):
        _load(tiny_llama_dir, weights)


def test_tied_lm_head_and_rotary_buffers_are_ignored(tiny_qwen2_dir: Path) -> None:
    assert load_checkpoint(str(tiny_qwen2_dir)).config.tie_word_embeddings
    weights = _weights(tiny_qwen2_dir)
    embedding = weights["model.embed_tokens.weight"]
    # A stale head saved beside a tied embedding: the output head must be the embedding.
    weights["lm_head.weight"] = torch.randn_like(embedding)
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    model = _load(tiny_qwen2_dir, weights)
    assert torch.equal(model.lm_head.weight, embedding)


def test_fused_projections_hold_the_hf_tensors(tiny_qwen3_dir: Path) -> None:
    weights = _weights(tiny_qwen3_dir)
    config = load_checkpoint(str(tiny_qwen3_dir)).config
    model = CausalLM(config, torch.float32, "cpu")
    model.load_weights(weights.items())
    layer = model.layers[1]
    prefix = "model.layers.1."
    expected_qkv = torch.cat([weights[f"{prefix}self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(layer.self_attn.qkv_proj.weight, expected_qkv)
    expected_gate_up = torch.cat([weights[f"{prefix}mlp.{p}_proj.weight"] for p in ("gate", "up")])
    assert torch.equal(layer.mlp.gate_up_proj.weight, expected_gate_up)
    assert torch.equal(layer.self_attn.qk_norm[0], weights[f"{prefix}self_attn.q_norm.weight"])
    assert torch.equal(layer.self_attn.qk_norm[-1], weights[f"{prefix}self_attn.k_norm.weight"])


def test_logits_have_float32_resolution_in_every_dtype(random_checkpoint: Checkpoint) -> None:
    """The LM head (and the final norm) compute in float32 under a bf16 body, so near-ties are
    decided at float32 resolution (SGLang's --enable-fp32-lm-head, always on)."""
    runner = PagedRunner(random_checkpoint, torch.bfloat16)
    assert runner.model.lm_head.weight.dtype == torch.float32
    tokens = random_checkpoint.tokenizer.encode("Float32 logits from a bf16 body")
    [logits] = runner.step({0: tokens}, all_logits=True)
    # A bf16 head rounds every logit to bf16's 8 significant bits; a float32 head does not.
    assert logits.dtype == torch.float32
    assert not torch.equal(logits, logits.bfloat16().float())


def test_float16_is_refused_on_cpu(random_checkpoint: Checkpoint) -> None:
    with pytest.raises(ValueError, match="float16"):
        CausalLM(random_checkpoint.config, torch.float16, "cpu")
