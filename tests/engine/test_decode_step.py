"""The native decode step (a C call per layer) against the model's forward, op by op."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers.decode_steps import CountingStep
from safetensors.torch import load_file, save_file

from baton import LLM, SamplingParams
from baton.bench.gguf_export import export_gguf
from baton.engine.attention.metadata import build_attention_metadata
from baton.engine.batch.forward_batch import ForwardBatch
from baton.engine.cpu.capabilities import detect_cpu_capabilities
from baton.engine.decode_step import NATIVE_STEP_MAX_ROWS
from baton.hardware import isa_rank

pytestmark = pytest.mark.skipif(
    isa_rank(detect_cpu_capabilities().isa) < isa_rank("avx2") or shutil.which("cc") is None,
    reason="the native kernels need an AVX2 CPU and a C compiler",
)

PLAIN_ROPE = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}


def _checkpoint(factory: Callable[..., Path], tmp_path: Path, variant: str, storage: str) -> Path:
    if storage == "bf16":
        return factory(variant, weights_dtype=torch.bfloat16)
    model_dir = factory(variant, vocab_size=300, **PLAIN_ROPE)
    return export_gguf(model_dir, "float32", tmp_path / f"{variant}-{storage}.gguf", storage)


@pytest.mark.parametrize("storage", ["bf16", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("variant", ["llama", "qwen2", "qwen3"])
def test_greedy_tokens_equal_the_eager_forward_at_every_batch_size(
    tiny_model_factory: Callable[..., Path], tmp_path: Path, variant: str, storage: str
) -> None:
    """Batches of 1, 5, 19 and NATIVE_STEP_MAX_ROWS rows run natively, one row more through
    the model's forward; prompts of different lengths make
    each row's page table and length differ."""
    path = _checkpoint(tiny_model_factory, tmp_path, variant, storage)
    native = LLM(str(path), dtype="float32")
    eager = LLM(str(path), dtype="float32", enforce_eager=True)
    assert native.engine.decode_step is not None and eager.engine.decode_step is None
    counting = native.engine.decode_step = CountingStep(native.engine.decode_step)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for batch in (1, 5, 19, NATIVE_STEP_MAX_ROWS, NATIVE_STEP_MAX_ROWS + 1):
        prompts = [[(7 * i + j) % 250 for j in range(3 + 5 * i)] for i in range(batch)]
        before = counting.batches
        got = [output.token_ids for output in native.generate(prompts, params)]
        want = [output.token_ids for output in eager.generate(prompts, params)]
        assert got == want, f"batch of {batch}"
        ran_natively = counting.batches - before
        # Each step decodes every row at once (the prompts all prefill in the first batch).
        assert ran_natively == (0 if batch > NATIVE_STEP_MAX_ROWS else 11)


def test_logits_match_the_eager_forward_on_the_same_batch(
    tiny_model_factory: Callable[..., Path],
) -> None:
    """Same cache, same batch, both paths: logits equal to float32 rounding."""
    llm = LLM(str(tiny_model_factory("qwen3", weights_dtype=torch.bfloat16)), dtype="float32")
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=1)
    lengths = [9, 20, 33]
    tables = [list(range(4 * row, 4 * row + 4)) for row in range(len(lengths))]

    def batch(kv_starts: list[int], q_lens: list[int], ids: list[int]) -> ForwardBatch:
        rows = range(len(q_lens))
        return ForwardBatch(
            ids, kv_starts, q_lens, tables, list(rows), list(rows), [params] * len(q_lens),
            [None] * len(q_lens), [[] for _ in rows],
        )  # fmt: skip

    prompt_ids = [token % 250 for n in lengths for token in range(n)]
    engine.forward(batch([0] * 3, lengths, prompt_ids))  # prefill: the model's forward
    decode = batch(lengths, [1, 1, 1], [5, 6, 7])
    meta_args = (decode.kv_starts, decode.q_lens, decode.page_tables, engine.page_size)
    meta = build_attention_metadata(*meta_args)
    assert engine.decode_step.handles(decode.q_lens)
    native_logits, tokens = engine.decode_step(
        decode.input_ids, decode.kv_starts, decode.page_tables, True
    )
    native_logits = native_logits.clone()
    ids, rows = torch.tensor(decode.input_ids), torch.arange(3)
    engine.attention.plan(meta)
    eager_logits = engine.model(ids, meta.positions, engine.kv_pool, engine.attention, meta, rows)
    torch.testing.assert_close(native_logits, eager_logits, rtol=1e-5, atol=1e-5)
    assert tokens == native_logits.argmax(dim=-1).tolist()


def test_a_model_without_compact_weights_decodes_op_by_op(
    tiny_model_factory: Callable[..., Path],
) -> None:
    """float32 safetensors: nothing compact to read, so no native decode step."""
    llm = LLM(str(tiny_model_factory("llama")), dtype="float32")
    assert llm.engine.decode_step is None


@pytest.mark.parametrize(
    "options",
    [
        {"chunk_size": 7},  # prompts prefill in chunks between decode steps
        {"page_size": 1},
        {"disable_overlap": True},
        {"enable_prefix_caching": False},
        # 14 pages of 16 tokens for six requests growing to ~100 tokens each: preemption.
        {"num_pages": 14, "max_model_len": 224},
    ],
    ids=repr,
)
def test_scheduling_around_the_native_step_keeps_the_eager_tokens(
    tiny_model_factory: Callable[..., Path], options: dict
) -> None:
    """Prefix hits (the prompts share a 24-token prefix), chunked prefill, page sizes and
    preemption change which batches run natively, never the tokens; pages all come back."""
    model_dir = tiny_model_factory("llama", weights_dtype=torch.bfloat16)
    shared = [(5 * j) % 250 for j in range(24)]
    prompts = [shared + [(11 * i + j) % 250 for j in range(3 + 4 * i)] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    eager = LLM(str(model_dir), dtype="float32", enforce_eager=True, **options)
    want = [output.token_ids for output in eager.generate(prompts, params)]
    native = LLM(str(model_dir), dtype="float32", **options)
    assert native.engine.decode_step is not None
    got = [output.token_ids for output in native.generate(prompts, params)]
    assert got == want
    stats = native.scheduler.aggregate_stats()
    assert stats.used_pages == 0 and stats.running_requests == stats.waiting_requests == 0
    if "num_pages" in options:
        assert stats.preemptions > 0


def _with_head(model_dir: Path, tmp_path: Path, edit: Callable[[torch.Tensor], None]) -> Path:
    """A copy of the checkpoint whose LM head `edit` has changed in place."""
    copy = tmp_path / "edited"
    shutil.copytree(model_dir, copy)
    weights_file = copy / "model.safetensors"
    weights = load_file(weights_file)
    edit(weights["lm_head.weight"])
    save_file(weights, weights_file, metadata={"format": "pt"})
    return copy


def _tied_rows(head: torch.Tensor) -> None:
    """Every row the same vector, the first 11 half of it: whatever the hidden state, the
    largest logit is shared by many tokens (the first 11 or all the others)."""
    head[:] = head[20]
    head[:11] *= 0.5


def _nan_row(head: torch.Tensor) -> None:
    head[7] = float("nan")


@pytest.mark.parametrize("edit", [_tied_rows, _nan_row], ids=["ties", "nan"])
def test_the_steps_argmax_picks_what_torch_argmax_picks(
    tiny_model_factory: Callable[..., Path], tmp_path: Path, edit: Callable[[torch.Tensor], None]
) -> None:
    """Ties go to the first maximum and a NaN logit wins, as in torch.argmax (the eager path
    samples greedy rows with it)."""
    model_dir = _with_head(
        tiny_model_factory("llama", weights_dtype=torch.bfloat16), tmp_path, edit
    )
    prompts = [[3, 4, 5], [9, 8, 7, 6, 5, 4, 3]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    native = LLM(str(model_dir), dtype="float32")
    eager = LLM(str(model_dir), dtype="float32", enforce_eager=True)
    got = [output.token_ids for output in native.generate(prompts, params)]
    assert got == [output.token_ids for output in eager.generate(prompts, params)]
    if edit is _nan_row:
        assert got == [[7] * 6] * 2


def test_rows_that_sample_or_want_logprobs_share_the_native_step(
    tiny_model_factory: Callable[..., Path],
) -> None:
    """A batch mixing plain greedy rows with rows that ask for logprobs, sample with a seed or
    must not end yet (min_tokens) runs natively and gives the eager path's tokens and
    logprobs."""
    model_dir = tiny_model_factory("qwen2", weights_dtype=torch.bfloat16)
    prompts = [[3 + i, 4, 5, 6 + i] for i in range(4)]
    params = [
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.8, seed=11, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=8, min_tokens=8),
    ]
    native = LLM(str(model_dir), dtype="float32")
    counting = native.engine.decode_step = CountingStep(native.engine.decode_step)
    eager = LLM(str(model_dir), dtype="float32", enforce_eager=True)
    got = native.generate(prompts, params)
    want = eager.generate(prompts, params)
    assert counting.batches == 7  # every decode step of the batch
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for got_entry, want_entry in zip(got[1].logprobs, want[1].logprobs, strict=True):
        assert [token for token, _ in got_entry.top] == [token for token, _ in want_entry.top]
        assert got_entry.logprob == pytest.approx(want_entry.logprob, abs=1e-4)
